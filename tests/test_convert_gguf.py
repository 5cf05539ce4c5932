"""Hugging Face safetensors -> GGUF F16 (and back), and MLX quantization through mlx-lm."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from localrun.errors import BadRequestError, LocalrunError, MalformedModelError, UnsupportedFormatError
from localrun.quant.hf_to_gguf import convert_hf_to_gguf

from test_quantize import THREADS, smollm2_cut_path, smollm2_f16_path


@pytest.fixture(scope="module")
def f16(smollm2_gguf, tmp_path_factory):
    return smollm2_f16_path(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def hf_gguf(smollm2_mlx, tmp_path_factory):
    """The MLX test model (Hugging Face layout, float16) converted by the CLI."""
    from localrun.cli import main

    out = tmp_path_factory.mktemp("hf2gguf") / "smollm2-from-hf.gguf"
    assert main(["convert", str(smollm2_mlx), "--to", "gguf", "-o", str(out)]) == 0
    return out


def _tensors(path: Path) -> dict:
    """name -> (ggml type, float32 array) for an F16/F32/Q8_0 GGUF, without GGUFReader's slow KV decode."""
    from gguf.quants import dequantize

    from localrun.model.gguf_check import check_gguf

    s = check_gguf(path)
    mm = np.memmap(path, np.uint8, mode="r")
    out = {}
    for t in s.tensors:
        raw = np.asarray(mm[s.data_offset + t.offset : s.data_offset + t.offset + t.nbytes])
        rows = raw.reshape(int(np.prod(t.shape[1:])), -1)
        out[t.name] = (t.ggml_type, np.asarray(dequantize(rows, t.ggml_type), np.float32))
    return out


def test_tokenizer_metadata_matches_the_original_gguf(hf_gguf, smollm2_gguf):
    from localrun.quant.gguf_io import UINT32, encode_kv, kv_entries

    a, b = dict(kv_entries(smollm2_gguf)), dict(kv_entries(hf_gguf))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "llama.block_count",
                "llama.attention.head_count_kv", "llama.rope.freq_base", "llama.context_length"):
        assert a[key] == b[key], key  # the encoded entries, byte for byte
    assert b["general.file_type"] == encode_kv("general.file_type", 1, UINT32)


def test_tensors_match_the_f16_gguf(hf_gguf, f16):
    """Same weights either way: the converter re-applies llama.cpp's Q/K row order exactly."""
    mine, ref = _tensors(hf_gguf), _tensors(f16)
    assert sorted(mine) == sorted(ref)
    for name, (kind, x) in ref.items():
        my_kind, y = mine[name]
        assert x.shape == y.shape and kind == my_kind, name
        if kind == 1:  # F16 matrices: bit for bit
            assert np.array_equal(x, y), name
        else:  # F32 norms went through MLX's float16 once
            np.testing.assert_allclose(y, x, rtol=1e-3, err_msg=name)


def test_round_trip_hf_gguf_hf_preserves_tensors(hf_gguf, smollm2_mlx, tmp_path):
    import mlx.core as mx

    from localrun.quant.gguf_to_mlx import convert_gguf_to_mlx

    back = convert_gguf_to_mlx(hf_gguf, tmp_path / "back")
    a = mx.load(str(smollm2_mlx / "model.safetensors"))
    b = mx.load(str(back / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.array(a[k]), np.array(b[k])), k


def test_converted_model_generates_like_the_source(hf_gguf, f16):
    from localrun.engine import Engine
    from localrun.sampling import SamplingParams

    outs = []
    for p in (hf_gguf, f16):
        with Engine.open(p, n_ctx=64, threads=THREADS) as eng:
            msgs = [{"role": "user", "content": "Name a colour."}]
            outs.append(eng.complete(eng.chat_prompt(msgs), sampling=SamplingParams(temperature=0), max_tokens=8).tokens)
    assert outs[0] == outs[1] and outs[0]


def _fake_hf(folder: Path, config: dict, tensors: bytes | None = None) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(tensors if tensors is not None else _safetensors())
    return folder


def _safetensors() -> bytes:
    data = np.arange(8, dtype=np.float32).tobytes()
    header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}).encode()
    return len(header).to_bytes(8, "little") + header + data


def test_conversion_errors_are_clear(tmp_path, smollm2_mlx):
    with pytest.raises(UnsupportedFormatError, match="architecture 'GPT2LMHeadModel'.*supported: LlamaForCausalLM"):
        convert_hf_to_gguf(_fake_hf(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"]}), tmp_path / "a.gguf")
    broken = tmp_path / "broken"
    shutil.copytree(smollm2_mlx, broken)
    st = broken / "model.safetensors"
    st.write_bytes(st.read_bytes()[: 10_000_000])
    with pytest.raises(MalformedModelError, match="truncated"):
        convert_hf_to_gguf(broken, tmp_path / "b.gguf")
    spm = tmp_path / "spm"
    shutil.copytree(smollm2_mlx, spm, ignore=shutil.ignore_patterns("*.safetensors"))
    (spm / "model.safetensors").write_bytes(_safetensors())
    tj = json.loads((spm / "tokenizer.json").read_text())
    tj["model"]["byte_fallback"] = True
    (spm / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(UnsupportedFormatError, match="byte fallback"):
        convert_hf_to_gguf(spm, tmp_path / "c.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial*"))


def test_cli_quantize_from_a_hugging_face_folder(smollm2_mlx, tmp_path, capsys):
    from localrun.cli import main

    out = tmp_path / "from-hf-q8_0.gguf"
    rc = main(["quantize", str(smollm2_mlx), "--type", "Q8_0", "-o", str(out), "--no-quality"])
    assert rc == 0, capsys.readouterr().err
    assert "converting" in capsys.readouterr().err
    assert _tensors(out)["blk.0.attn_q.weight"][0] == 8  # GGML_TYPE_Q8_0
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # the F16 stage is gone


# --- MLX ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_4bit(smollm2_mlx, tmp_path_factory):
    from localrun.cli import main

    out = tmp_path_factory.mktemp("mlx") / "smollm2-4bit"
    assert main(["quantize", str(smollm2_mlx), "--bits", "4", "-o", str(out), "--no-quality"]) == 0
    return out


def test_mlx_4bit_loads(mlx_4bit, smollm2_mlx):
    from localrun.backends import open_backend

    cfg = json.loads((mlx_4bit / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
    size = sum(p.stat().st_size for p in mlx_4bit.glob("*.safetensors"))
    base = sum(p.stat().st_size for p in smollm2_mlx.glob("*.safetensors"))
    assert size < 0.35 * base
    b = open_backend(mlx_4bit, n_ctx=64)
    try:
        assert b.info.backend == "mlx" and b.info.n_vocab == 49152
    finally:
        b.close()


def test_mlx_errors(mlx_4bit, smollm2_mlx, tmp_path, capsys):
    from localrun.cli import main
    from localrun.quant.quantize_mlx import quantize_mlx

    with pytest.raises(BadRequestError, match="--bits must be one of 2, 3, 4, 5, 6, 8"):
        quantize_mlx(smollm2_mlx, tmp_path / "x", bits=7)
    with pytest.raises(BadRequestError, match="already quantized"):
        quantize_mlx(mlx_4bit, tmp_path / "y", bits=4)
    with pytest.raises(BadRequestError, match="unknown MLX recipe 'mixed_9_9'"):
        quantize_mlx(smollm2_mlx, tmp_path / "z", bits=3, recipe="mixed_9_9")
    with pytest.raises(LocalrunError, match="already exists and is not empty"):
        quantize_mlx(smollm2_mlx, mlx_4bit, bits=4)
    assert main(["quantize", str(smollm2_mlx), "--bits", "4", "--type", "Q4_K_M"]) == 1
    assert "not --type" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_convert_gguf_to_mlx_with_bits_generates(smollm2_gguf, tmp_path_factory, tmp_path):
    """4-bit MLX runs slowly on a Linux CPU (~15 s a token for the whole model on the CI
    box), so the generation check runs on the 4-layer cut."""
    from localrun.cli import main
    from localrun.engine import Engine
    from localrun.sampling import SamplingParams

    cut = smollm2_cut_path(smollm2_gguf, tmp_path_factory)
    out = tmp_path / "cut-mlx-4bit"
    assert main(["convert", str(cut), "--to", "mlx", "--bits", "4", "-o", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["num_hidden_layers"] > 0
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the float16 stage is gone
    with Engine.open(out, n_ctx=32) as eng:
        assert eng.info.backend == "mlx"
        c = eng.complete("Hi", sampling=SamplingParams(temperature=0), max_tokens=2, lookup=False)
        assert c.tokens

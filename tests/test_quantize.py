"""GGUF quantization through ggml_quantize_chunk with localrun's per-tensor recipe.

The models are built once per session under pytest's base temp folder: an F16 GGUF of
SmolLM2 (dequantized from the Q4_1 test model), a 4-layer cut of it for the i-quants
(ggml's i-quant search costs ~0.3 us per weight, ~30 s per i-quant of the whole model on
one core, so the i-quant tests run on the first 4 of its 30 layers), and the K-quant
ladder. Other quant test modules import the builders from here."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from syncs import record_syncs

from localrun.errors import BadRequestError, LocalrunError, MalformedModelError
from localrun.quant import ggml_lib
from localrun.quant.quantize_gguf import quantize_gguf
from localrun.quant.recipe import FILE_TYPES, TensorPlanner, file_type

T_ = __import__("gguf").GGMLQuantizationType
THREADS = 1  # the CI box has 2 busy cores; llama.cpp's spinning threads lose on a shared core
DATA = Path(__file__).parent / "data"
CUT_LAYERS = 4


def _base(tmp_path_factory) -> Path:
    d = tmp_path_factory.getbasetemp() / "quant-models"
    d.mkdir(exist_ok=True)
    return d


def smollm2_f16_path(src: Path, tmp_path_factory) -> Path:
    """SmolLM2 as F16 (widening a quantized source needs no --allow-requantize)."""
    out = _base(tmp_path_factory) / "smollm2-f16.gguf"
    if not out.exists():
        quantize_gguf(src, out, "F16")
    return out


def cut_layers(src: Path, out: Path, n_layers: int) -> Path:
    """A GGUF with only the first `n_layers` blocks (block_count patched): a smaller real model."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch=arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        value = n_layers if key == f"{arch}.block_count" else f.contents()
        sub = gguf.GGUFValueType(f.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(reversed([int(d) for d in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def smollm2_cut_path(src: Path, tmp_path_factory) -> Path:
    out = _base(tmp_path_factory) / f"smollm2-f16-{CUT_LAYERS}layers.gguf"
    if not out.exists():
        cut_layers(smollm2_f16_path(src, tmp_path_factory), out, CUT_LAYERS)
    return out


def quant_path(src_f16: Path, type_name: str, tmp_path_factory, imatrix=None, tag: str = "") -> Path:
    out = _base(tmp_path_factory) / f"{src_f16.stem}-{type_name}{tag}.gguf"
    if not out.exists():
        quantize_gguf(src_f16, out, type_name, imatrix=imatrix)
    return out


LADDER = ["Q8_0", "Q6_K", "Q4_K_M", "Q3_K_S"]


@pytest.fixture(scope="module")
def f16(smollm2_gguf, tmp_path_factory):
    return smollm2_f16_path(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def ladder(f16, tmp_path_factory):
    return {t: quant_path(f16, t, tmp_path_factory) for t in LADDER}


# --- the recipe, without a model ------------------------------------------------------


def test_every_file_type_plans_a_type_that_fits_every_tensor():
    shapes = {"token_embd.weight": (4096, 32000), "output.weight": (4096, 32000),
              "blk.0.attn_q.weight": (4096, 4096), "blk.0.attn_v.weight": (4096, 1024),
              "blk.0.ffn_down.weight": (11008, 4096), "blk.31.ffn_down.weight": (11008, 4096),
              "blk.5.ffn_up.weight": (576, 1536), "blk.0.attn_norm.weight": (4096,)}
    from localrun.quant.recipe import block_of, is_quantizable

    for name in FILE_TYPES:
        p = TensorPlanner(file_type(name), n_layer=32, n_gqa=4, has_imatrix=True)
        for t, shape in shapes.items():
            if is_quantizable(t, shape):
                got = p.choose(t, shape)
                assert shape[0] % block_of(got) == 0, (name, t, got)
    assert not is_quantizable("blk.0.attn_norm.weight", (4096,))


def test_q4_k_m_mixture_gives_sensitive_tensors_more_bits():
    p = TensorPlanner(file_type("q4_k_m"), n_layer=32, n_gqa=4)
    assert p.choose("output.weight", (4096, 32000)) == T_.Q6_K
    assert p.choose("blk.0.ffn_down.weight", (11008, 4096)) == T_.Q6_K  # first eighth
    assert p.choose("blk.5.ffn_down.weight", (11008, 4096)) == T_.Q4_K  # (5-4) % 3 != 2
    assert p.choose("blk.6.attn_v.weight", (4096, 1024)) == T_.Q6_K  # (6-4) % 3 == 2
    assert p.choose("blk.10.attn_q.weight", (4096, 4096)) == T_.Q4_K
    # a 576-wide row cannot hold 256-value K blocks: the 32-block neighbour, noted
    assert p.choose("blk.10.attn_q.weight", (576, 576)) == T_.Q5_0
    assert any("blk.10.attn_q.weight" in f for f in p.fallbacks)


def test_unknown_type_is_a_clear_error():
    with pytest.raises(BadRequestError, match="unknown quantization type 'Q4_K_X'.*Q4_K_M"):
        file_type("Q4_K_X")


# --- the kernel -----------------------------------------------------------------------


def test_kernel_error_shrinks_with_bits_and_the_importance_matrix_reaches_it():
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    err = {}
    for t in (T_.Q8_0, T_.Q6_K, T_.Q4_K, T_.Q3_K):
        q = ggml_lib.quantize_rows(int(t), w, threads=2)
        assert q.nbytes == 64 * ggml_lib.row_size(int(t), 512)
        err[t] = float(np.mean((dequantize(q.reshape(64, -1), t) - w) ** 2))
    assert err[T_.Q8_0] < err[T_.Q6_K] < err[T_.Q4_K] < err[T_.Q3_K]

    # Columns the matrix says matter get a smaller error than under uniform weights
    # (weights only shift the error within a block, so every other column matters).
    imp = np.ones(512, np.float32)
    imp[::2] = 1000.0
    qi = dequantize(ggml_lib.quantize_rows(int(T_.IQ3_XXS), w, imp).reshape(64, -1), T_.IQ3_XXS)
    qu = dequantize(ggml_lib.quantize_rows(int(T_.IQ3_XXS), w, np.ones(512, np.float32)).reshape(64, -1), T_.IQ3_XXS)
    assert np.mean((qi - w)[:, ::2] ** 2) < 0.8 * np.mean((qu - w)[:, ::2] ** 2)
    with pytest.raises(BadRequestError, match="needs an importance matrix"):
        ggml_lib.quantize_rows(int(T_.IQ2_XXS), w)


# --- whole models ---------------------------------------------------------------------


def test_ladder_loads_and_generates_in_localrun_and_llama_cpp(ladder):
    import llama_cpp

    from localrun.engine import Engine
    from localrun.sampling import SamplingParams

    for name, path in ladder.items():
        with Engine.open(path, n_ctx=128, threads=THREADS) as eng:
            assert eng.info.quant == name
            c = eng.complete("The capital of France is", sampling=SamplingParams(temperature=0), max_tokens=6)
            assert c.tokens and c.text.strip(), name
        llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=THREADS, verbose=False)
        try:
            out = llm("The capital of France is", max_tokens=4, temperature=0)["choices"][0]["text"]
            assert out.strip(), name
        finally:
            llm.close()


def test_sizes_shrink_down_the_ladder(ladder, f16):
    sizes = [f16.stat().st_size] + [ladder[t].stat().st_size for t in LADDER]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)


def test_same_bytes_as_llama_model_quantize(f16, ladder, tmp_path):
    """llama.cpp's own quantizer, run in-process, writes the very same tensors."""
    import gguf
    import llama_cpp

    ref = tmp_path / "ref-q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES["Q4_K_M"].ftype
    params.nthread = THREADS
    rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(ref).encode(), ctypes.byref(params))
    assert rc == 0
    a, b = gguf.GGUFReader(ref), gguf.GGUFReader(ladder["Q4_K_M"])
    mine = {t.name: t for t in b.tensors}
    assert sorted(t.name for t in a.tensors) == sorted(mine)
    for t in a.tensors:
        assert t.tensor_type == mine[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(mine[t.name].data).view(np.uint8)), t.name
    assert ref.stat().st_size == ladder["Q4_K_M"].stat().st_size


# --- safety ---------------------------------------------------------------------------


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".partial-" in p.name]


def test_quantized_source_needs_allow_requantize(smollm2_gguf, tmp_path):
    out = tmp_path / "requant.gguf"
    with pytest.raises(BadRequestError, match="already quantized.*--allow-requantize"):
        quantize_gguf(smollm2_gguf, out, "Q4_0")
    assert not out.exists()
    warnings = []
    res = quantize_gguf(smollm2_gguf, out, "Q4_0", allow_requantize=True, warn=warnings.append)
    assert res.requantized and out.exists() and "requantizing" in warnings[0]


def test_refuses_existing_output_and_the_source_itself(f16, tmp_path):
    with pytest.raises(BadRequestError, match="output path is the source"):
        quantize_gguf(f16, f16, "Q8_0", overwrite=True)
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"keep me")
    with pytest.raises(LocalrunError, match="already exists.*--force"):
        quantize_gguf(f16, taken, "Q8_0")
    assert taken.read_bytes() == b"keep me"


def test_truncated_source_is_a_clear_error(f16, tmp_path):
    cut = tmp_path / "truncated.gguf"
    with open(f16, "rb") as f:
        cut.write_bytes(f.read(f16.stat().st_size // 3))
    out = tmp_path / "out.gguf"
    with pytest.raises(MalformedModelError, match="truncated"):
        quantize_gguf(cut, out, "Q8_0")
    assert not out.exists() and not _leftovers(tmp_path)


def test_interrupt_and_full_disk_leave_nothing_at_out(f16, tmp_path, monkeypatch):
    out = tmp_path / "out.gguf"

    def interrupt(what, done, total):
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_gguf(f16, out, "Q8_0", progress=interrupt)
    assert not out.exists() and not _leftovers(tmp_path)

    from localrun.quant import gguf_io

    real = gguf_io.GGUFOut.write
    calls = {"n": 0}

    def full_disk(self, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(gguf_io.GGUFOut, "write", full_disk)
    with pytest.raises(LocalrunError, match="No space left on device; nothing was left at"):
        quantize_gguf(f16, out, "Q8_0")
    assert not out.exists() and not _leftovers(tmp_path)


def test_finished_output_is_fsynced_before_its_rename_and_its_folder_after(tmp_path, monkeypatch):
    """A rename alone can reach the disk before the bytes do (a power cut leaves a named,
    empty or torn file): the file is synced first, the folder holding the new name after."""
    from localrun.quant.atomic import atomic_output, replace_durably

    events = record_syncs(monkeypatch)
    out = tmp_path / "out.gguf"
    with atomic_output(out) as tmp:
        tmp.write_bytes(b"GGUF finished bytes")
    assert out.read_bytes() == b"GGUF finished bytes"
    file_ino, folder_ino = out.stat().st_ino, tmp_path.stat().st_ino
    assert events == [("fsync", "file", file_ino), ("replace", file_ino, out), ("fsync", "dir", folder_ino)]

    # a finished folder (an MLX model): every file and the folder itself before the rename
    events.clear()
    staged = tmp_path / ".model.partial"
    staged.mkdir()
    (staged / "config.json").write_text("{}")
    (staged / "model.safetensors").write_bytes(b"weights")
    inodes = {p.stat().st_ino for p in staged.iterdir()} | {staged.stat().st_ino}
    replace_durably(staged, tmp_path / "model")
    *before, rename, after = events
    assert {ino for _, _, ino in before} == inodes and rename[0] == "replace" and rename[2] == tmp_path / "model"
    assert after == ("fsync", "dir", folder_ino)


def test_a_folder_that_cannot_be_fsynced_is_skipped(tmp_path, monkeypatch):
    """Some file systems (and Windows) refuse to fsync a folder: the data was synced; go on."""
    import errno
    import stat

    from localrun.quant.atomic import atomic_output

    real_fsync = os.fsync
    synced_files = []

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        synced_files.append(os.fstat(fd).st_ino)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out.bin"
    with atomic_output(out) as tmp:
        tmp.write_bytes(b"x")
    assert out.read_bytes() == b"x" and not _leftovers(tmp_path)
    assert synced_files == [out.stat().st_ino]  # the bytes were still synced


def test_low_bit_types_refuse_to_run_without_an_importance_matrix(f16, tmp_path):
    for t in ("IQ2_XXS", "IQ1_S", "IQ2_M"):
        with pytest.raises(BadRequestError, match=f"{t} needs an importance matrix.*--imatrix.*--calibration"):
            quantize_gguf(f16, tmp_path / "x.gguf", t)


def test_cli_quantize_with_calibration_reports_quality(smollm2_gguf, tmp_path_factory, tmp_path, capsys):
    """Q2_K_S needs an importance matrix: --calibration computes it on the way."""
    import gguf

    from localrun.cli import main

    cut = smollm2_cut_path(smollm2_gguf, tmp_path_factory)
    out = tmp_path / "cut-q2_k_s.gguf"
    assert main(["quantize", str(cut), "--type", "Q2_K_S", "-o", str(out)]) == 1
    assert "needs an importance matrix" in capsys.readouterr().err and not out.exists()
    short = tmp_path_factory.mktemp("eval") / "short.txt"  # ~3 chunks: the report is what is tested
    short.write_text("\n\n".join((DATA / "heldout.txt").read_text().split("\n\n")[:2]))
    rc = main(["quantize", str(cut), "--type", "Q2_K_S", "-o", str(out), "--threads", str(THREADS),
               "--calibration", str(DATA / "calibration.txt"), "--chunk-size", "128",
               "--eval-text", str(short), "--eval-ctx", "64"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert cap.out.strip() == str(out)
    assert "bits/weight" in cap.err and "KLD mean" in cap.err and out.name in cap.err
    fields = gguf.GGUFReader(out).fields
    assert fields["quantize.imatrix.dataset"].contents() == "calibration.txt"
    assert fields["quantize.imatrix.entries_count"].contents() == 4 * 7
    assert main(["quantize", str(cut), "--type", "Q5_K_M", "-o", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["quantize", str(cut), "--bits", "4"]) == 1
    assert "--bits is for MLX" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "nope.gguf"), "--type", "Q4_0"]) == 1
    assert "no model at" in capsys.readouterr().err
    assert main(["quantize", str(cut), "--type", "Q4_0", "--imatrix", str(cut), "-o", str(tmp_path / "x.gguf")]) != 0
    assert "not an imatrix GGUF" in capsys.readouterr().err
    assert os.listdir(tmp_path) == [out.name]

"""`localrun imatrix`: activations collected through llama.cpp's eval callback, saved in
llama.cpp's imatrix GGUF format."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from localrun.errors import BadRequestError, MalformedModelError
from localrun.quant.imatrix_file import ImportanceMatrix, load_imatrix, save_imatrix

from test_quantize import DATA, THREADS, smollm2_f16_path

CHUNK = 64
CHUNKS = 2


def _llama_tool(name: str) -> str:
    """The native llama.cpp tool that scripts/setup.sh builds (scripts/build_llama_tools.sh)
    from the source the installed llama-cpp-python vendors: that version's and no other."""
    import llama_cpp

    roots = [os.environ.get("LOCALRUN_TOOLS", ""), str(Path.home() / ".cache" / "localrun" / "tools")]
    for root in filter(None, roots):
        tool = Path(root) / f"llama.cpp-{llama_cpp.__version__}" / "build" / "bin" / name
        if tool.is_file():
            return str(tool)
    pytest.fail(f"native {name} for llama-cpp-python {llama_cpp.__version__} is not built: run scripts/setup.sh")


@pytest.fixture(scope="module")
def f16(smollm2_gguf, tmp_path_factory):
    return smollm2_f16_path(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def imatrix_file(f16, tmp_path_factory):
    from localrun.cli import main

    out = tmp_path_factory.mktemp("imatrix") / "smollm2.imatrix.gguf"
    rc = main(["imatrix", str(f16), "--calibration", str(DATA / "calibration.txt"), "-o", str(out),
               "--chunk-size", str(CHUNK), "--max-chunks", str(CHUNKS), "--threads", str(THREADS)])
    assert rc == 0
    return out


def test_file_has_llama_cpp_layout(imatrix_file):
    import gguf

    r = gguf.GGUFReader(imatrix_file)
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.datasets"].contents() == ["calibration.txt"]
    assert r.fields["imatrix.chunk_count"].contents() == CHUNKS
    assert r.fields["imatrix.chunk_size"].contents() == CHUNK
    assert "general.architecture" not in r.fields
    t = {x.name: x for x in r.tensors}
    # 30 layers x 7 matrices (q, k, v, o, gate, up, down); none for the tied embedding
    assert len(t) == 2 * 30 * 7
    q = t["blk.0.attn_q.weight.in_sum2"]
    assert [int(d) for d in q.shape] == [576, 1] and q.tensor_type == gguf.GGMLQuantizationType.F32
    assert [int(d) for d in t["blk.0.ffn_down.weight.in_sum2"].shape] == [1536, 1]
    assert [int(d) for d in t["blk.0.attn_q.weight.counts"].shape] == [1, 1]


def test_every_matrix_saw_every_token_including_the_last_layer(imatrix_file):
    im = load_imatrix(imatrix_file)
    for name, counts in im.counts.items():
        assert counts.tolist() == [CHUNK * CHUNKS], name
        assert (im.sums[name] >= 0).all() and im.sums[name].sum() > 0, name


def test_first_layer_sums_match_numpy(imatrix_file, f16):
    """blk.0's q/k/v read rmsnorm(embedding) * attn_norm: recompute it from the weights."""
    import gguf
    from gguf.quants import dequantize

    from localrun.backends.llamacpp import LlamaCppBackend

    b = LlamaCppBackend(f16, n_ctx=64, threads=THREADS)
    try:
        text = (DATA / "calibration.txt").read_text()
        tokens = b.tokenize(text, add_special=b.info.add_bos, parse_special=False)[: CHUNK * CHUNKS]
        if b.info.add_bos:
            tokens[::CHUNK] = [b.info.bos_id] * CHUNKS
    finally:
        b.close()
    r = gguf.GGUFReader(f16)
    t = {x.name: x for x in r.tensors}
    emb = dequantize(t["token_embd.weight"].data, t["token_embd.weight"].tensor_type).reshape(-1, 576)
    norm = np.asarray(t["blk.0.attn_norm.weight"].data, np.float64)
    eps = float(r.fields["llama.attention.layer_norm_rms_epsilon"].contents())
    x = emb[tokens].astype(np.float64)
    x = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * norm
    want = (x * x).sum(axis=0)
    im = load_imatrix(imatrix_file)
    for m in ("attn_q", "attn_k", "attn_v"):
        np.testing.assert_allclose(im.sums[f"blk.0.{m}.weight"][0], want, rtol=2e-3, atol=1e-4)
    # and not just any positive numbers: another layer's inputs differ
    assert not np.allclose(im.sums["blk.1.attn_q.weight"][0], want, rtol=0.05)


def test_save_load_round_trip_and_mean(tmp_path):
    im = ImportanceMatrix(datasets=["a.txt"], chunk_count=3, chunk_size=8)
    im.add("blk.0.attn_q.weight", np.array([1.0, 4.0, 9.0]), rows=4)
    im.add("blk.0.attn_q.weight", np.array([1.0, 0.0, 3.0]), rows=4)
    p = save_imatrix(im, tmp_path / "x.gguf")
    back = load_imatrix(p)
    assert back.datasets == ["a.txt"] and back.chunk_count == 3 and back.chunk_size == 8
    np.testing.assert_allclose(back.mean("blk.0.attn_q.weight"), [[0.25, 0.5, 1.5]])
    assert back.mean("blk.9.attn_q.weight") is None
    assert [x.name for x in tmp_path.iterdir()] == ["x.gguf"]


def test_errors_are_one_line(f16, tmp_path, capsys):
    from localrun.cli import main
    from localrun.quant.imatrix import compute_imatrix

    with pytest.raises(BadRequestError, match="fewer than one chunk of 512"):
        compute_imatrix(f16, "Too short.", chunk_size=512)
    with pytest.raises(MalformedModelError, match="not an imatrix GGUF.*localrun imatrix"):
        load_imatrix(f16)
    assert main(["imatrix", str(f16), "--calibration", str(tmp_path / "none.txt"), "-o", str(tmp_path / "o")]) == 1
    assert "cannot read the calibration file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_llama_cpp_tools_read_it(imatrix_file, smollm2_gguf, tmp_path_factory, tmp_path):
    """llama-quantize accepts the file and quantizes exactly as localrun does with it."""
    from test_quantize import smollm2_cut_path

    from localrun.quant.quantize_gguf import quantize_gguf

    tool = _llama_tool("llama-quantize")
    cut = smollm2_cut_path(smollm2_gguf, tmp_path_factory)
    ref, mine = tmp_path / "ref.gguf", tmp_path / "mine.gguf"
    run = subprocess.run([tool, "--imatrix", str(imatrix_file), str(cut), str(ref), "Q4_K_S", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "loaded 210 importance matrix entries" in run.stdout + run.stderr
    quantize_gguf(cut, mine, "Q4_K_S", imatrix=load_imatrix(imatrix_file), threads=1)
    import gguf

    a, b = gguf.GGUFReader(ref), {t.name: t for t in gguf.GGUFReader(mine).tensors}
    for t in a.tensors:
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(b[t.name].data).view(np.uint8)), t.name

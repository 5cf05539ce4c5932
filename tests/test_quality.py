"""Perplexity / KL divergence against the source, the table and the plot; the i-quants
with and without an importance matrix."""

from __future__ import annotations

import numpy as np
import pytest

from localrun.errors import BadRequestError
from localrun.quant import quality as Q
from localrun.quant.imatrix_file import load_imatrix, uniform_like

from test_quantize import DATA, LADDER, THREADS, quant_path, smollm2_cut_path, smollm2_f16_path

CTX = 128
CHUNKS = 3  # 3 chunks x 63 scored tokens = 189 tokens


@pytest.fixture(scope="module")
def f16(smollm2_gguf, tmp_path_factory):
    return smollm2_f16_path(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def cut(smollm2_gguf, tmp_path_factory):
    return smollm2_cut_path(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def heldout() -> str:
    return (DATA / "heldout.txt").read_text()


@pytest.fixture(scope="module")
def ladder_rows(f16, heldout, tmp_path_factory):
    ref = Q.reference_logprobs(f16, heldout, ctx=CTX, max_chunks=CHUNKS, threads=THREADS)
    return {t: Q.measure(quant_path(f16, t, tmp_path_factory), ref, name=t, threads=THREADS) for t in LADDER}


@pytest.fixture(scope="module")
def cut_imatrix(cut, tmp_path_factory):
    from localrun.cli import main

    out = tmp_path_factory.mktemp("cut-imatrix") / "cut.imatrix.gguf"
    assert main(["imatrix", str(cut), "--calibration", str(DATA / "calibration.txt"), "-o", str(out),
                 "--chunk-size", "128", "--threads", str(THREADS)]) == 0
    return load_imatrix(out)


def test_kld_orders_the_ladder(ladder_rows):
    kld = [ladder_rows[t].kld_mean for t in LADDER]
    assert kld == sorted(kld) and len(set(kld)) == len(kld), kld  # Q8_0 < Q6_K < Q4_K_M < Q3_K_S
    for r in ladder_rows.values():
        assert r.n_tokens == CHUNKS * (CTX // 2 - 1)
        assert 0 < r.kld_mean <= r.kld_p99 <= r.kld_max
        assert r.base_ppl == ladder_rows["Q8_0"].base_ppl
    assert ladder_rows["Q8_0"].top1_agree > 0.9 > ladder_rows["Q3_K_S"].top1_agree
    assert ladder_rows["Q3_K_S"].ppl > ladder_rows["Q8_0"].base_ppl
    bpw = [ladder_rows[t].bits_per_weight for t in LADDER]
    assert bpw == sorted(bpw, reverse=True)


def test_source_against_itself_is_lossless(cut, heldout):
    ref = Q.reference_logprobs(cut, heldout, ctx=CTX, max_chunks=2, threads=THREADS)
    row = Q.measure(cut, ref, threads=THREADS)
    assert row.kld_max < 1e-5 and row.top1_agree == 1.0
    assert row.ppl == pytest.approx(row.base_ppl, rel=1e-5)
    # a 4-layer cut of the 30-layer model predicts text badly (its head expects layer 30's
    # stream), but it is still one deterministic function: what KLD comparisons need
    assert np.isfinite(row.ppl) and row.ppl > 1


def test_imatrix_iq3_xxs_beats_uniform_weights(cut, cut_imatrix, heldout, tmp_path_factory):
    """Same recipe, same kernel; only the per-column weights differ."""
    with_im = quant_path(cut, "IQ3_XXS", tmp_path_factory, imatrix=cut_imatrix, tag="-imatrix")
    uniform = quant_path(cut, "IQ3_XXS", tmp_path_factory, imatrix=uniform_like(cut_imatrix), tag="-uniform")
    ref = Q.reference_logprobs(cut, heldout, ctx=CTX, max_chunks=CHUNKS, threads=THREADS)
    a = Q.measure(with_im, ref, threads=THREADS)
    b = Q.measure(uniform, ref, threads=THREADS)
    assert a.size_bytes == b.size_bytes
    assert a.kld_mean < b.kld_mean, (a.kld_mean, b.kld_mean)


def test_iquants_load_and_generate(cut, cut_imatrix, tmp_path_factory):
    import llama_cpp

    from localrun.engine import Engine
    from localrun.sampling import SamplingParams

    for t in ("IQ4_XS", "IQ3_XXS"):
        path = quant_path(cut, t, tmp_path_factory, imatrix=cut_imatrix, tag="-imatrix")
        with Engine.open(path, n_ctx=64, threads=THREADS) as eng:
            assert eng.info.quant == t
            c = eng.complete("Once upon a time", sampling=SamplingParams(temperature=0), max_tokens=4)
            assert len(c.tokens) >= 1
        llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=THREADS, verbose=False)
        try:
            assert llm("Once upon a time", max_tokens=3, temperature=0)["choices"][0]["text"]
        finally:
            llm.close()


def test_table_and_plot(ladder_rows, tmp_path):
    rows = list(ladder_rows.values())
    table = Q.format_table(rows)
    lines = table.splitlines()
    assert "KLD mean" in lines[0] and "KLD p99" in lines[0]
    assert [ln.split()[0] for ln in lines[2:6]] == LADDER
    assert f"{ladder_rows['Q4_K_M'].kld_mean:.5f}" in table
    png = Q.plot(rows, tmp_path / "ladder.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert [p.name for p in tmp_path.iterdir()] == ["ladder.png"]


def test_cli_quality(cut, cut_imatrix, tmp_path_factory, tmp_path, capsys):
    from localrun.cli import main

    q = quant_path(cut, "IQ4_XS", tmp_path_factory, imatrix=cut_imatrix, tag="-imatrix")
    png = tmp_path / "plot.png"
    rc = main(["quality", str(q), str(cut), "--base", str(cut), "--text", str(DATA / "heldout.txt"),
               "--ctx", "64", "--max-chunks", "2", "--plot", str(png), "--threads", str(THREADS)])
    out = capsys.readouterr().out
    assert rc == 0
    assert q.name[:28] in out and "source PPL" in out and png.exists()
    rows = [ln for ln in out.splitlines() if ln.startswith(cut.name[:28])]
    assert rows and float(rows[0].split()[6]) == 0.0  # the source scores KLD 0 against itself


def test_a_different_vocabulary_is_refused(cut):
    ref = Q.Reference(str(cut), tokens=[1] * 32, ctx=16, positions=np.arange(8, 16),
                      logprobs=np.zeros((8, 7), np.float32), n_vocab=7)
    with pytest.raises(BadRequestError, match="not the same model"):
        Q.measure(cut, ref)


def test_text_shorter_than_a_chunk(cut):
    with pytest.raises(BadRequestError, match="shorter than one chunk"):
        Q.reference_logprobs(cut, "Hello there.", ctx=64, threads=THREADS)


def test_agrees_with_llama_perplexity(f16, ladder_rows, heldout, tmp_path_factory, tmp_path):
    """llama.cpp's own `llama-perplexity --kl-divergence` on the same text and context.

    (On the full model: llama.cpp stores the base log-probabilities in 16 bits with a
    floor, so its numbers drift on a model as poor as the 4-layer cut.)"""
    import re
    import subprocess

    from test_imatrix import _llama_tool

    tool = _llama_tool("llama-perplexity")
    q = quant_path(f16, "Q4_K_M", tmp_path_factory)
    text, base = tmp_path / "heldout.txt", tmp_path / "base.kld"
    text.write_text(heldout)
    # quant/quality.py measures every model with flash attention off (not the choice timed
    # per file); the two attention kernels round differently, so the native tool must match it.
    common = ["-c", str(CTX), "-b", str(CTX), "--chunks", str(CHUNKS), "-t", str(THREADS), "-fa", "off",
              "--kl-divergence-base", str(base)]
    for args in (["-m", str(f16), "-f", str(text)], ["-m", str(q), "--kl-divergence"]):
        run = subprocess.run([tool, *args, *common], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
    log = run.stdout + run.stderr
    ppl_q = float(re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", log).group(1))
    ppl_base = float(re.search(r"Mean PPL\(base\)\s*:\s*([\d.]+)", log).group(1))
    kld = float(re.search(r"Mean\s+KLD:\s*([\d.]+)", log).group(1))
    row = ladder_rows["Q4_K_M"]
    assert row.base_ppl == pytest.approx(ppl_base, rel=1e-3)
    assert row.ppl == pytest.approx(ppl_q, rel=1e-3)
    assert row.kld_mean == pytest.approx(kld, rel=0.02)  # llama.cpp keeps the base in 16 bits

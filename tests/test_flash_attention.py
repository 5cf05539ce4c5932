"""Flash attention on llama.cpp: with an f16 cache on the CPU, whichever of on and off
timed faster for the model on this machine (remembered per model, machine, threads and
KV type); on where a quantized cache needs it; llama.cpp's own choice on a GPU; and
LOCALRUN_FLASH_ATTN over all of it."""

import numpy as np
import pytest

from localrun.backends.base import BatchEntry
from localrun.backends.attention import CPU_SCORES_MAX_BYTES, FLASH_ATTN_ENV, MEASURE, flash_attention_choice
from localrun.backends.llamacpp import LlamaCppBackend
from localrun.errors import ModelLoadError


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(FLASH_ATTN_ENV, raising=False)


def test_cpu_f16_cache_is_timed():
    assert flash_attention_choice("f16", on_cpu=True, score_bytes=1 << 20) == MEASURE


def test_scores_past_the_bound_leave_it_to_llama_cpp():
    assert flash_attention_choice("f16", on_cpu=True, score_bytes=CPU_SCORES_MAX_BYTES + 1) == "auto"


def test_a_gpu_leaves_it_to_llama_cpp():
    assert flash_attention_choice("f16", on_cpu=False, score_bytes=1 << 20) == "auto"


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_quantized_cache_needs_it_everywhere(kv):
    assert flash_attention_choice(kv, on_cpu=True, score_bytes=1 << 20) == "on"
    assert flash_attention_choice(kv, on_cpu=False, score_bytes=1 << 20) == "on"


@pytest.mark.parametrize("value", ["on", "off", "auto", " OFF "])
def test_the_environment_overrides(monkeypatch, value):
    monkeypatch.setenv(FLASH_ATTN_ENV, value)
    assert flash_attention_choice("f16", on_cpu=True, score_bytes=1 << 20) == value.strip().lower()
    assert flash_attention_choice("f16", on_cpu=False, score_bytes=1 << 40) == value.strip().lower()


def test_a_bad_override_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(FLASH_ATTN_ENV, "yes")
    with pytest.raises(ModelLoadError, match="use on, off or auto"):
        flash_attention_choice("f16", on_cpu=True, score_bytes=0)


def test_turning_it_off_under_a_quantized_cache_is_refused(monkeypatch):
    monkeypatch.setenv(FLASH_ATTN_ENV, "off")
    with pytest.raises(ModelLoadError, match="needs flash attention"):
        flash_attention_choice("q8_0", on_cpu=True, score_bytes=0)


def _last_row(backend, tokens):
    backend.kv_clear(0)
    return np.array(backend.decode([BatchEntry(0, tokens, 0, 1)])[0][-1])


def test_the_choice_reaches_llama_cpp(smollm2_gguf, monkeypatch):
    """Off and on change the kernel (the logits move a little), not the model (the same
    greedy token)."""
    monkeypatch.setenv(FLASH_ATTN_ENV, "off")
    off = LlamaCppBackend(smollm2_gguf, n_ctx=256)
    try:
        assert off.flash_attn == "off"
        tokens = off.tokenize("The quick brown fox jumps over the lazy dog, and then it")
        row_off = _last_row(off, tokens)
    finally:
        off.close()
    monkeypatch.setenv(FLASH_ATTN_ENV, "on")
    on = LlamaCppBackend(smollm2_gguf, n_ctx=256)
    try:
        assert on.flash_attn == "on"
        row_on = _last_row(on, tokens)
    finally:
        on.close()
    assert int(row_off.argmax()) == int(row_on.argmax())
    # the option, for numbers that must not depend on the choice (quant/quality.py), wins over it all
    pinned = LlamaCppBackend(smollm2_gguf, n_ctx=256, flash_attn="off")  # the environment still says "on"
    try:
        assert pinned.flash_attn == "off"
        assert np.array_equal(_last_row(pinned, tokens), row_off)
    finally:
        pinned.close()
    assert not np.array_equal(row_off, row_on)
    # a little: up to ~0.9 on an AVX2 EPYC (both kernels and a prompt-sized batch), far below the logits' spread
    assert np.abs(row_off - row_on).max() < 2.0

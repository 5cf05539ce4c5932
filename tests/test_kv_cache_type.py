"""--kv-cache-type: quantized KV caches on both backends.

A q8_0 cache must change the answers little (greedy tokens agree with f16's), hold
about half of f16's bytes per cached token (q4_0 about a quarter), and keep every KV
edit the engine relies on (trim, copy, prefix reuse) exact. The f16 references are the
session engines from conftest, so each backend loads only its quantized variants here.
"""

from __future__ import annotations

import numpy as np
import pytest

from localrun.backends import open_backend
from localrun.backends.base import BatchEntry
from localrun.cli import main
from localrun.engine import Engine
from localrun.errors import BadRequestError
from localrun.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
PROMPT = "The capital of France is"


def greedy_ids(engine: Engine, prompt: str, n: int) -> list[int]:
    """The first n greedy tokens after `prompt` (lookup off: one token per step)."""
    return engine.complete(engine.tokenize(prompt), sampling=GREEDY, max_tokens=n, lookup=False).tokens


def filled_state_bytes(engine: Engine, tokens: list[int], seq: int) -> int:
    """kv_state_bytes of `seq` holding exactly `tokens`; the sequence is cleared after."""
    b = engine.backend
    b.kv_clear(seq)
    b.decode([BatchEntry(seq, tokens, 0, 1)])
    size = b.kv_state_bytes(seq)
    b.kv_clear(seq)
    return size


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("opener", [Engine.open, open_backend])
def test_unknown_kv_cache_type_is_a_one_line_error_naming_the_flag(opener, smollm2_gguf):
    with pytest.raises(BadRequestError) as exc:
        opener(smollm2_gguf, n_ctx=64, kv_cache_type="q5_1")
    msg = str(exc.value)
    assert "--kv-cache-type" in msg and "q5_1" in msg
    assert all(k in msg for k in ("f16", "q8_0", "q4_0")) and "\n" not in msg


def test_run_rejects_an_unknown_kv_cache_type_before_loading(smollm2_gguf, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", str(smollm2_gguf), "hi", "--kv-cache-type", "q5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-type" in err and "q8_0" in err and "Traceback" not in err


def test_run_with_a_q8_0_cache_answers(smollm2_gguf, capsys):
    rc = main(["run", str(smollm2_gguf), PROMPT, "--raw", "--kv-cache-type", "q8_0", "--ctx", "64",
               "--temperature", "0", "--max-tokens", "4", "--no-lookup", "--threads", "1"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


# -- llama.cpp ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_q8(smollm2_gguf):
    with Engine.open(smollm2_gguf, n_ctx=256, n_seq=2, threads=1, kv_cache_type="q8_0") as eng:
        yield eng


def test_llama_q8_0_greedy_matches_f16_and_halves_the_cache(llama_engine, llama_q8):
    assert llama_q8.backend.kv_cache_type == "q8_0"
    ref, got = greedy_ids(llama_engine, PROMPT, 8), greedy_ids(llama_q8, PROMPT, 8)
    assert got[:4] == ref[:4], (llama_q8.detokenize(got), llama_engine.detokenize(ref))
    tokens = llama_engine.tokenize(PROMPT * 8)
    f16, q8 = filled_state_bytes(llama_engine, tokens, 1), filled_state_bytes(llama_q8, tokens, 1)
    # q8_0 keeps 34 bytes per 32 values against f16's 64; the state also holds a small
    # header and the token positions, so the ratio sits a little above 34/64.
    assert 0.45 < q8 / f16 < 0.6, (q8, f16)


def test_llama_q8_0_two_sequences_in_one_decode_match_solo(llama_q8):
    # A quantized cache needs flash attention on: two sequences decoded in one batch
    # must still each see only their own keys.
    b = llama_q8.backend
    a, c = b.tokenize("Hello there, my friend"), b.tokenize("Numbers: 1, 2, 3, 4")
    solo = []
    for toks in (a, c):
        b.kv_clear(0)
        solo.append(b.decode([BatchEntry(0, toks, 0, 1)])[0][-1].copy())
    b.kv_clear(0)
    together = b.decode([BatchEntry(0, a, 0, 1), BatchEntry(1, c, 0, 1)])
    for row, ref in zip(together, solo):
        assert int(row[-1].argmax()) == int(ref.argmax())
        assert np.abs(row[-1] - ref).max() < 0.05
    b.kv_clear(0)
    b.kv_clear(1)


def test_llama_q4_0_loads_generates_and_quarters_the_cache(smollm2_gguf, llama_engine):
    with Engine.open(smollm2_gguf, n_ctx=128, threads=1, kv_cache_type="q4_0") as eng:
        ids = greedy_ids(eng, PROMPT, 4)
        assert len(ids) == 4 and eng.detokenize(ids).strip()
        tokens = eng.tokenize(PROMPT * 8)
        q4 = filled_state_bytes(eng, tokens, 0)
    f16 = filled_state_bytes(llama_engine, tokens, 1)
    assert 0.2 < q4 / f16 < 0.35, (q4, f16)  # 18 bytes per 32 values against 64


# -- MLX ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_q8(smollm2_mlx):
    with Engine.open(smollm2_mlx, n_ctx=256, n_seq=2, kv_cache_type="q8_0") as eng:
        yield eng


def test_mlx_q8_0_uses_quantized_caches_and_matches_f16(mlx_engine, mlx_q8):
    from mlx_lm.models.cache import QuantizedKVCache

    b = mlx_q8.backend
    assert b.kv_cache_type == "q8_0"
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 8 for c in b._caches[0])
    ref, got = greedy_ids(mlx_engine, PROMPT, 4), greedy_ids(mlx_q8, PROMPT, 4)
    assert got[:3] == ref[:3], (mlx_q8.detokenize(got), mlx_engine.detokenize(ref))
    tokens = b.tokenize(PROMPT * 4)
    f16, q8 = filled_state_bytes(mlx_engine, tokens, 1), filled_state_bytes(mlx_q8, tokens, 1)
    # 8-bit codes plus an f16 scale and bias per 64 values: 68 bytes against 128
    assert 0.5 < q8 / f16 < 0.56, (q8, f16)


def test_mlx_q8_0_trim_copy_and_continued_generation(mlx_q8):
    b = mlx_q8.backend
    story = "Once upon a time"
    b.kv_clear(0)
    b.kv_clear(1)
    computed_whole = greedy_ids(mlx_q8, story, 3)  # no cached prefix to reuse yet

    toks = b.tokenize(story + ", in a small village by the sea, there lived")
    n = len(toks)
    b.kv_clear(0)
    b.kv_clear(1)
    whole = b.decode([BatchEntry(0, toks, 0, 1)])[0][-1].copy()

    b.kv_trim(0, n - 3)
    assert b.kv_tokens(0) == toks[: n - 3]
    again = b.decode([BatchEntry(0, toks[n - 3 :], n - 3, 1)])[0][-1].copy()
    assert int(again.argmax()) == int(whole.argmax())
    assert np.abs(again - whole).max() < 0.1

    # a copy of the first n-2 positions continues like the original; the original is untouched
    b.kv_copy(0, 1, n - 2)
    assert b.kv_tokens(1) == toks[: n - 2]
    copied = b.decode([BatchEntry(1, toks[n - 2 :], n - 2, 1)])[0][-1].copy()
    assert np.abs(copied - whole).max() < 0.1
    assert b.kv_tokens(0) == toks
    after = b.decode([BatchEntry(0, [int(whole.argmax())], n, 1)])[0][-1]
    assert np.isfinite(after).all()

    # the engine reuses a trimmed quantized cache as the prompt's prefix and answers
    # as it did from nothing
    b.kv_trim(1, 2)
    b.kv_clear(0)
    reused = mlx_q8.complete(mlx_q8.tokenize(story), sampling=GREEDY, max_tokens=3, lookup=False)
    assert reused.timings.cached_tokens == 2
    assert reused.tokens == computed_whole

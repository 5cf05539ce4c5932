"""The fused chain (localrun/sampling/fused.py) against the staged chain it replaces:
same candidates, probabilities within 1e-6, same draws for the same seed, on whole
vocabulary rows; which chains take it; the caller's row is left as it was."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localrun.sampling import Sampler, SamplingParams
from localrun.sampling.fused import FusedChain

CHAINS = {
    "default": {},
    "repeat 1.1": dict(repeat_penalty=1.1),
    "every penalty": dict(repeat_penalty=0.7, frequency_penalty=0.3, presence_penalty=-0.2, repeat_last_n=-1),
    "narrow": dict(top_k=5, top_p=0.5, min_p=0.2, temperature=1.7),
    "dry and bias": dict(dry_multiplier=0.8, repeat_penalty=1.3, logit_bias={3: 5.0, 17: -math.inf}),
    "reordered": dict(samplers=["penalties", "top_k", "temperature", "min_p", "top_p"], repeat_penalty=1.2,
                      min_p=0.9, min_keep=3),
    "top-p off, k 200": dict(top_k=200, top_p=1.0, min_p=0.0, temperature=0.5),
}


def fused_and_staged(seed: int, **kw) -> tuple[Sampler, Sampler]:
    fused = Sampler(SamplingParams(seed=seed, **kw))
    staged = Sampler(SamplingParams(seed=seed, **kw))
    staged._fused = None
    assert fused._fused is not None
    return fused, staged


def a_row(rng, n: int) -> tuple[np.ndarray, list[int]]:
    x = (rng.standard_normal(n) * rng.uniform(0.5, 4)).astype(np.float32)
    history = rng.integers(0, n, 150).tolist() + np.argsort(-x)[:12].tolist()  # the top ones were said
    return x, history


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("n", [16_384, 49_152, 100_003, 262_144])
def test_fused_matches_the_staged_chain(chain, n):
    rng = np.random.default_rng(n + len(chain))
    for trial in range(4):
        x, history = a_row(rng, n)
        before = x.copy()
        fused, staged = fused_and_staged(trial, **CHAINS[chain])
        ids, probs = fused.distribution(x, history)
        want_ids, want_probs = staged.distribution(x, history)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(probs, want_probs, rtol=0, atol=1e-6)
        assert probs.dtype == np.float64 and ids.dtype == np.int64
        draws = [fused.sample(x, history) for _ in range(50)]
        assert draws == [staged.sample(x, history) for _ in range(50)]
        np.testing.assert_array_equal(x, before)  # the penalties went back out of the row


def test_a_read_only_row_is_copied_not_written():
    x, history = a_row(np.random.default_rng(5), 262_144)
    x.flags.writeable = False
    fused, staged = fused_and_staged(1, repeat_penalty=1.5)
    assert fused.sample(x, history) == staged.sample(x, history)
    np.testing.assert_array_equal(fused.distribution(x, history)[0], staged.distribution(x, history)[0])


def test_a_ctypes_row_is_penalised_and_restored():
    """llama.cpp's rows are numpy views of a ctypes buffer, whose format is '<f'."""
    import ctypes

    buf = (ctypes.c_float * 49_152)()
    x = np.ctypeslib.as_array(buf)
    x[:] = np.random.default_rng(6).standard_normal(x.size)
    before = x.copy()
    history = np.argsort(-x)[:20].tolist()
    fused, staged = fused_and_staged(2, repeat_penalty=2.0)
    np.testing.assert_array_equal(fused.distribution(x, history)[0], staged.distribution(x, history)[0])
    np.testing.assert_array_equal(x, before)


def test_top_k_finds_the_top_in_one_column_and_past_the_last_whole_row():
    """The top k all sit in one column of the (rows, 4096) view, and some ids past the
    last whole row beat everything."""
    x = np.random.default_rng(7).standard_normal(262_147).astype(np.float32)
    x[0 : 50 * 4096 : 4096] += 50
    ids, _ = Sampler(SamplingParams(top_k=40, top_p=1.0, min_p=0.0, seed=0)).distribution(x, [])
    assert set(ids.tolist()) <= set(range(0, 50 * 4096, 4096)) and len(ids) == 40
    x[-3:] += 100
    ids, _ = Sampler(SamplingParams(top_k=5, top_p=1.0, min_p=0.0, seed=0)).distribution(x, [])
    assert {262_144, 262_145, 262_146} <= set(ids.tolist()) and 1 not in ids


def test_tied_logits_keep_the_lower_ids_first():
    x = np.zeros(65_536, np.float32)
    x[[9000, 7, 40_000, 123]] = 5.0
    ids, probs = Sampler(SamplingParams(top_k=3, top_p=1.0, min_p=0.0, seed=0)).distribution(x, [])
    assert ids.tolist() == [7, 123, 9000] and 40_000 not in ids
    assert probs == pytest.approx([1 / 3] * 3)


def test_rows_whose_coarse_bound_fails_still_give_the_exact_top_k():
    """A row of two values (ties by the thousand at the top: the bound from 64 blocks lets
    most columns through) and a grammar row whose allowed ids sit in a few blocks (that
    bound is -inf): the top k by logit, then id, all the same."""
    rng = np.random.default_rng(11)
    quantized = (rng.random(262_144) < 0.02).astype(np.float32)
    masked = np.full(262_144, -np.inf, np.float32)
    masked[rng.choice(1000, 60, replace=False)] = rng.standard_normal(60)
    spread = rng.standard_normal(262_144).astype(np.float32)  # the common case, for contrast
    chain = FusedChain.plan(SamplingParams(top_k=40, top_p=1.0, min_p=0.0))
    for x in (quantized, masked, spread):
        want = np.lexsort((np.arange(x.size), -x))[:40].tolist()
        for top in (chain.top, chain.top_numpy):  # the C pass where built, and numpy's
            ids, values = top(x)
            assert ids == want and values == x[want].tolist()


@pytest.mark.parametrize("chain", CHAINS)
def test_a_grammar_masked_row_gives_the_staged_chains_tokens_and_draws(chain, monkeypatch):
    """Fewer allowed ids than k: the fused path's candidates are the staged chain's of
    nonzero probability, with the same probabilities and draws; a NaN row or one that
    allows nothing is still the staged chain's."""
    rng = np.random.default_rng(len(chain))
    x = np.full(151_936, -np.inf, np.float32)
    n = CHAINS[chain].get("top_k", 40) - 1  # one fewer than k
    x[rng.choice(151_936, n, replace=False)] = rng.standard_normal(n) * 3
    fused, staged = fused_and_staged(3, **CHAINS[chain])
    history = np.flatnonzero(x > -np.inf)[:2].tolist()  # penalised tokens among the allowed ones
    calls = []
    allowed = FusedChain.allowed
    monkeypatch.setattr(FusedChain, "allowed", lambda self, row: calls.append(1) or allowed(self, row))
    ids, probs = fused.distribution(x, history)
    assert calls  # the fused path took the row
    want_ids, want_probs = staged.distribution(x, history)
    kept = want_probs > 0
    np.testing.assert_array_equal(ids, want_ids[kept])
    np.testing.assert_allclose(probs, want_probs[kept], rtol=0, atol=1e-6)
    assert [fused.sample(x, history) for _ in range(50)] == [staged.sample(x, history) for _ in range(50)]
    chain_plan = FusedChain.plan(SamplingParams(**CHAINS[chain]))
    assert chain_plan.allowed(np.full(151_936, -np.inf, np.float32)) is None
    nan_row = x.copy()
    nan_row[7] = np.nan
    assert chain_plan.allowed(nan_row) is None


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0),
        dict(mirostat=2),
        dict(top_k=0),
        dict(top_k=2000),
        dict(typical_p=0.9),
        dict(xtc_probability=0.5),
        dict(top_n_sigma=1.0),
        dict(dynatemp_range=0.5),
        dict(samplers=["top_p", "top_k", "temperature"]),
        dict(samplers=["top_k", "top_p", "top_k"]),
    ],
)
def test_chains_the_fused_path_does_not_cover_run_stage_by_stage(kw):
    assert FusedChain.plan(SamplingParams(**kw)) is None


def test_stages_that_change_nothing_do_not_block_the_fused_path():
    p = SamplingParams(xtc_probability=0.5, xtc_threshold=0.6, typical_p=1.0, top_n_sigma=-1)
    assert FusedChain.plan(p) is not None
    assert FusedChain.plan(SamplingParams(temperature=1.0, top_p=1.0, min_p=0.0)).tail == ()


def test_small_rows_take_the_staged_chain():
    s = Sampler(SamplingParams(seed=0))
    assert s._fused.candidates(np.zeros(1000, np.float32), [], s._stage) is None
    assert s._fused.candidates(np.zeros(50_000, np.float64), [], s._stage) is None


@pytest.mark.parametrize("chain", CHAINS)
def test_the_one_call_draw_is_the_lists_draw(chain, monkeypatch):
    """_topk.top_k_draw (the whole tail and the draw in C) picks the id that
    `truncate`'s lists and a bisect over their running totals pick, for the same
    uniform, on every row and uniform tried, and leaves the row as it was."""
    from localrun.sampling import fused as fused_module

    if fused_module._native_top_k_draw is None:
        pytest.fail("the C sampler extension was not built (a C compiler is part of the setup)")
    rng = np.random.default_rng(17 + len(chain))
    plan = FusedChain.plan(SamplingParams(**CHAINS[chain]))
    stage = Sampler(SamplingParams(**CHAINS[chain]))._stage
    for trial in range(6):
        x, history = a_row(rng, 49_152 if trial % 2 else 151_936)
        if trial == 5:
            x *= 0.01  # a flat row: many candidates survive every cut
        before = x.copy()
        uniforms = rng.random(60).tolist() + [0.0, 1 - 2**-53]
        for u in uniforms:
            got = plan.draw(x, history, stage, lambda: u)
            monkeypatch.setattr(fused_module, "_native_top_k_draw", None)
            want = plan.draw(x, history, stage, lambda: u)
            monkeypatch.undo()
            assert got == want, (trial, u)
        np.testing.assert_array_equal(x, before)
    asked = []
    masked = np.full(49_152, -np.inf, np.float32)
    masked[[5, 9]] = [1.0, 2.0]  # fewer than k allowed: the lists' path, random() asked once

    def uniform():
        asked.append(1)
        return 0.5

    token = plan.draw(masked, [], stage, uniform)
    assert token in (5, 9) and asked == [1]
    masked[9] = np.nan
    assert plan.draw(masked, [], stage, lambda: pytest.fail("drew for a NaN row")) is None

"""Sampling over the whole vocabulary (top-k 0, no truncation): the block-wise draw picks
what one running total over every id would (Sampler._draw_whole), and a grammar holds
such a chain by redrawing what it refuses (localrun.grammar.redraw) with the law of the
masked row, computing the full mask only after REDRAWS refusals."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import EOS, N_VOCAB, ScriptedBackend
from test_speculative import chi_square

from localrun.engine import Engine
from localrun import engine as engine_module
from localrun.grammar import redraw
from localrun.grammar.core import Grammar
from localrun.grammar.matcher import GrammarMatcher
from localrun.sampling import SamplingParams
from localrun.sampling.sampler import Sampler, _draw_whole

WHOLE = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)


def flat_draw(weights: np.ndarray, u: float) -> int:
    cum = np.cumsum(weights.astype(np.float64))
    return int(np.searchsorted(cum, u * cum[-1], side="right"))


@pytest.mark.parametrize("n", [4097, 5 * 1024, 151936])
def test_the_block_draw_picks_what_one_running_total_picks(n):
    rng = np.random.default_rng(n)
    weights = np.exp(rng.standard_normal(n).astype(np.float32) * 3)
    weights[rng.choice(n, n // 3, replace=False)] = 0.0  # masked ids
    for u in list(rng.random(2000)) + [0.0, 1e-12, 1 - 1e-12]:
        got = _draw_whole(weights, u)
        assert weights[got] > 0
        assert got == min(flat_draw(weights, u), n - 1) or abs(
            np.cumsum(weights.astype(np.float64))[got] / weights.sum(dtype=np.float64) - u) < 1e-9


def test_the_block_draw_never_picks_a_zero_weight_at_a_blocks_end():
    """Each block's weight in its first ids only, spread over 30 orders of magnitude: a pick
    clamped to a block's end by rounding would land on a zero."""
    rng = np.random.default_rng(3)
    weights = np.zeros(8 * 1024, np.float32)
    for b in range(8):
        weights[b * 1024 : b * 1024 + 3] = 10.0 ** rng.uniform(-15, 15, 3)
    picked = {_draw_whole(weights, u) for u in np.concatenate([rng.random(20000), np.linspace(0, 1 - 1e-12, 20001)])}
    assert picked and all(weights[i] > 0 for i in picked)


def test_a_uniform_next_to_one_picks_the_last_id_that_weighs():
    weights = np.zeros(4 * 1024, np.float32)
    weights[[10, 2 * 1024 + 5]] = [1.0, 3.0]  # the last block and a half weigh nothing
    assert _draw_whole(weights, np.nextafter(1.0, 0.0)) == 2 * 1024 + 5
    assert _draw_whole(weights, 1.0) == 2 * 1024 + 5  # even past the end of [0, 1)


def test_a_whole_vocabulary_sample_is_the_distributions_draw():
    row = np.random.default_rng(0).standard_normal(152_000).astype(np.float32) * 3
    fast, slow = Sampler(WHOLE), Sampler(WHOLE)
    for _ in range(500):
        assert fast.sample(row, [1, 2]) == slow.draw(*slow.distribution(row, [1, 2]))


@pytest.mark.parametrize("params, reweighs", [
    (WHOLE, True),
    (SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.2, presence_penalty=0.5,
                    logit_bias={5: -2.0}, dry_multiplier=0.8), True),
    (SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0), False),
    (SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0), False),
    (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05), False),
    (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.9), False),
    (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, xtc_probability=0.5), False),
    (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, dynatemp_range=0.5), False),
    (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, mirostat=2), False),
    (SamplingParams(temperature=0), False),
])
def test_reweighs_only_when_no_stage_cuts_ids(params, reweighs):
    assert Sampler(params).reweighs_only() is reweighs


# -- a grammar over a whole-vocabulary chain ----------------------------------------------

LETTERS = "abcdef"  # what the grammar allows first; the model prefers "z" (refused) and "a"


def letter_logits(hist: list[int]) -> np.ndarray:
    row = np.full(N_VOCAB, -4.0, np.float32)
    row[ord("z")], row[ord("a")], row[ord("b")], row[ord("q")] = 3.0, 2.0, 1.0, 2.5
    row[EOS] = 0.0
    return row


def first_tokens(seeds: int) -> np.ndarray:
    eng = Engine(ScriptedBackend(logits_fn=letter_logits, n_ctx=64))
    counts = np.zeros(N_VOCAB)
    grammar = Grammar.from_regex(f"[{LETTERS}]+")  # compiled once
    for seed in range(seeds):
        sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        done = eng.complete([ord("x")], sampling=sampling, max_tokens=1, grammar=grammar)
        counts[done.tokens[0]] += 1
    return counts


def test_redrawing_keeps_the_masked_rows_law(monkeypatch):
    row = letter_logits([])
    allowed = [ord(c) for c in LETTERS]
    law = np.exp(row[allowed] - row[allowed].max())
    law /= law.sum()
    applied = []
    real_apply = GrammarMatcher.apply
    monkeypatch.setattr(GrammarMatcher, "apply", lambda self, logits: (applied.append(1), real_apply(self, logits))[1])
    redrawn = first_tokens(1500)
    masks_while_redrawing = len(applied)
    with monkeypatch.context() as patch:
        patch.setattr(engine_module, "redraws", lambda g: False)
        masked = first_tokens(1500)
    assert len(applied) - masks_while_redrawing == 1500  # the masked path masks every draw
    for counts in (redrawn, masked):
        assert counts.sum() == counts[allowed].sum()  # only what the grammar allows
        assert chi_square(counts[allowed], law) < 20.5  # 5 degrees of freedom: p = 0.001
    # the model's favourites ("z", "q") are refused: most draws were redrawn, few masked
    assert masks_while_redrawing < 1500 / 4


def test_after_redraws_run_out_the_full_mask_decides(monkeypatch):
    monkeypatch.setattr(redraw, "REDRAWS", 0)
    applied = []
    real_apply = GrammarMatcher.apply
    monkeypatch.setattr(GrammarMatcher, "apply", lambda self, logits: (applied.append(1), real_apply(self, logits))[1])
    eng = Engine(ScriptedBackend(logits_fn=letter_logits, n_ctx=64))
    done = eng.complete([ord("x")], sampling=WHOLE, max_tokens=3, grammar=Grammar.from_regex(f"[{LETTERS}]+"))
    assert done.text and set(done.text) <= set(LETTERS) and applied


def test_a_stretch_of_refusals_masks_the_next_steps_at_once(monkeypatch):
    """The model always prefers what the grammar refuses: after the first step's redraws
    run out, steps mask at once (1, then 2, 4 ... in a row), not REDRAWS draws each."""
    allowed_asked = []
    real_allows = GrammarMatcher.allows
    monkeypatch.setattr(GrammarMatcher, "allows", lambda self, t: (allowed_asked.append(t), real_allows(self, t))[1])

    def refused_first(hist: list[int]) -> np.ndarray:
        row = np.full(N_VOCAB, -20.0, np.float32)
        row[ord("z")], row[ord("q")], row[ord("y")], row[ord("w")], row[ord("a")] = 9.0, 9.0, 9.0, 9.0, 0.0
        return row

    eng = Engine(ScriptedBackend(logits_fn=refused_first, n_ctx=64))
    done = eng.complete([ord("x")], sampling=WHOLE, max_tokens=8, grammar=Grammar.from_regex("a+"))
    assert done.text == "a" * 8
    # steps 1 (4 refusals), 2-3 (masked: 1 + ... ), ...: far fewer than 8 steps x 4 asks
    assert len(allowed_asked) < 8 * redraw.REDRAWS / 2, len(allowed_asked)

"""Prompt lookup under sampling on a real model (SmolLM2, llama.cpp): the tokens that come
out of a speculative step follow the model's own probabilities, and each row of that
step is sampled exactly as a plain step samples it (same chain, same random draw).

The prompt asks SmolLM2 to repeat a sentence and already holds the answer's first words,
"The committee": with its prefix cached, a generation's very first step is speculative,
the pending " committee" plus the draft " approved the" copied from the sentence, three
rows in one decode. Under the pure model law (temperature 1, no truncation) SmolLM2 gives
" approved" ~0.95, then " the" ~0.85 (" a" ~0.12), then " new" ~0.92: drafts are kept and
rejected at every row, and a verifier that kept a draft without the sampling check would
move those probabilities a long way. The scripted-backend tests in test_speculative.py
check the same laws on exact toy probabilities.
"""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from localrun.backends.base import BatchEntry
from localrun.engine import Engine
from localrun.sampling import Sampler, SamplingParams
from localrun.speculation.lookup import LookupConfig

TEXT = (
    "The committee approved the new budget on Tuesday. The budget funds three new parks, "
    "a library renovation and longer bus hours."
)
LAW = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)  # the model's softmax, nothing else
# A fixed, low row cost: every step drafts what the match offers (draft lengths must not
# depend on how fast this machine happens to be)
ALWAYS = LookupConfig(measure_cost=False, cost_per_draft=0.05)
RUNS = 400  # seeds 0..399, three tokens each
# The chi-square test's level: with fixed seeds the outcome is deterministic, and a
# correct verifier fails it for one seed set in 100,000
ALPHA = 1e-5


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): 1 - the regularized lower gamma P(df/2, x/2)
    (its series; good to ~1e-15 absolute, far below any level used here)."""
    a, z = df / 2, x / 2
    if z <= 0:
        return 1.0
    term = total = 1 / a
    n = 1
    while term > 1e-17 * total:
        term *= z / (a + n)
        total += term
        n += 1
    return max(0.0, 1.0 - math.exp(-z + a * math.log(z) - math.lgamma(a)) * total)


def softmax(row: np.ndarray) -> np.ndarray:
    z = np.asarray(row, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def runs(smollm2_gguf):
    """RUNS seeded generations of three tokens with lookup on, and the rows they were
    sampled from. One slot and one thread: the prompt's KV is read once and reused by
    every run, and a row decoded twice in the same batch shape comes out bit-identical."""
    with Engine.open(smollm2_gguf, n_ctx=256, n_seq=1, threads=1) as eng:
        be = eng.backend
        prompt = eng.chat_prompt([{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}])
        prompt += eng.tokenize("The committee", add_special=False)
        draft = eng.tokenize(" approved the", add_special=False)
        assert len(draft) == 2
        outs = [eng.complete(prompt, sampling=SamplingParams(seed=seed, **LAW), max_tokens=3, lookup=ALWAYS)
                for seed in range(RUNS)]
        # The rows each run's first step read: the pending token and the draft in one decode
        # at the cached prefix (the KV every run reused) ...
        n = len(prompt) - 1
        assert be.kv_tokens(0)[:n] == prompt[:n]
        be.kv_trim(0, n)
        wide = np.array(be.decode([BatchEntry(0, [prompt[-1]] + draft, n, 3)])[0])
        # ... and the rows lookup off reads for the same positions, one token per step
        be.kv_trim(0, n)
        alone = [np.array(be.decode([BatchEntry(0, [t], n + i, 1)])[0][0]) for i, t in enumerate([prompt[-1]] + draft)]
        yield SimpleNamespace(prompt=prompt, draft=draft, outs=outs, wide=wide, alone=alone, stops=eng.info.stop_ids)


def first_step(tokens: list[int], draft: list[int]) -> list[int]:
    """The tokens the first (speculative) step emitted: up to and including the first one
    that differs from the draft, or every draft token plus the last row's."""
    for i, t in enumerate(tokens):
        if i == len(draft) or t != draft[i]:
            return tokens[: i + 1]
    return tokens


def test_every_run_drafted_and_each_drafted_row_both_kept_and_rejected(runs):
    """The laws below are tested where lookup really verified: every run's first step
    carried the draft, and each drafted token was kept in some runs, rejected in others."""
    outs, draft = runs.outs, runs.draft
    assert all(o.timings.drafted >= len(draft) for o in outs)
    # per drafted position, among the runs that reached it: kept in some, rejected in others
    verdicts = [Counter(o.tokens[: i + 1] == draft[: i + 1] for o in outs if o.tokens[:i] == draft[:i])
                for i in range(len(draft))]
    assert all(v[True] and v[False] for v in verdicts), verdicts


def test_each_row_of_a_speculative_step_is_sampled_as_a_plain_step_samples_it(runs):
    """speculator.py: 'samples each row exactly as without speculation (same chain, same
    RNG draw) and keeps a draft while it equals the sampled token'. A sampler seeded like
    the run's, drawing from the same rows one after the other, must give the very tokens
    the engine emitted in its speculative step, for every seed: any other use of the
    random stream (a draw more or less per judged draft) or of the rows shows here."""
    prompt, draft, outs, stops = runs.prompt, runs.draft, runs.outs, runs.stops
    for seed, out in enumerate(outs):
        s = Sampler(SamplingParams(seed=seed, **LAW))
        history, replay = list(prompt), []
        for i, row in enumerate(runs.wide):
            t = s.sample(row, history)
            if t in stops:  # the end-of-turn token is not output, and the answer ends
                assert out.tokens == replay, (seed, replay, out.tokens)
                break
            replay.append(t)
            history.append(t)
            if i == len(draft) or t != draft[i]:
                assert first_step(out.tokens, draft) == replay, (seed, replay, out.tokens)
                break


def test_sampled_tokens_follow_the_models_own_probabilities(runs):
    """README: 'a draft token is kept with its probability under the full chain, so the
    output distribution is unchanged'. The first three tokens' joint law, built from
    the rows lookup off would read (one token per step), against RUNS seeded runs with
    lookup on: cells down the drafted path (" approved", then " the", then any third
    token), every other token where at least 5 runs are expected, the rest pooled per
    position; chi-square at level ALPHA."""
    draft, outs = runs.draft, runs.outs
    laws = [softmax(r) for r in runs.alone]
    cells: dict[tuple[int, int | None], float] = {}
    reach = 1.0  # the probability of having followed the draft so far
    for level, p in enumerate(laws):
        follows = draft[level] if level < len(draft) else None
        for t in np.flatnonzero(reach * p * RUNS >= 5).tolist():
            if t != follows:
                cells[(level, t)] = reach * p[t]
        leaving = reach * (1.0 - (p[follows] if follows is not None else 0.0))
        cells[(level, None)] = leaving - sum(v for (lv, _), v in cells.items() if lv == level)
        if follows is not None:
            reach *= p[follows]

    def cell(tokens: list[int]) -> tuple[int, int | None]:
        for level in range(len(laws)):
            t = tokens[level] if level < len(tokens) else -1  # -1: it ended the turn
            if level < len(draft) and t == draft[level]:
                continue
            return (level, t) if (level, t) in cells else (level, None)
        raise AssertionError(tokens)

    seen = Counter(cell(o.tokens) for o in outs)
    assert set(seen) <= set(cells)
    stat = sum((seen[k] - RUNS * e) ** 2 / (RUNS * e) for k, e in cells.items())
    p_value = chi2_sf(stat, len(cells) - 1)
    drift = [0.5 * np.abs(softmax(w) - p).sum() for w, p in zip(runs.wide, laws)]
    table = ", ".join(f"{k}: {seen[k]} vs {RUNS * e:.1f}" for k, e in sorted(cells.items(), key=lambda kv: -kv[1]))
    print(f"\nlookup-law chi2 {stat:.2f} df {len(cells) - 1} p {p_value:.3g};"
          f" wide vs one-row rows, total variation {[f'{d:.4f}' for d in drift]}; {table}")
    assert len(cells) >= 5  # rows with real alternatives, not a forced copy
    assert p_value > ALPHA, table

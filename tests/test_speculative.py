"""Prompt-lookup speculation: the proposer on literal arrays, exactness of verification
(identity at temperature 0, unchanged distribution under sampling), state and limits."""

from __future__ import annotations

import numpy as np
import pytest

from localrun.engine import Engine
from localrun.sampling import SamplingParams
from localrun.speculative import DraftController, LookupConfig, propose

from fakes import EOS, N_VOCAB, ScriptedBackend

GREEDY = SamplingParams(temperature=0)


# -- proposer -------------------------------------------------------------------------


def test_propose_takes_what_followed_the_most_recent_match():
    assert propose([5, 6, 7, 9, 5, 6], 1, 3, 3) == [7, 9, 5]
    # two earlier occurrences of [1, 2]: the most recent one (followed by 4) wins, not 3
    assert propose([1, 2, 3, 1, 2, 4, 1, 2], 2, 2, 1) == [4]


def test_propose_prefers_the_longest_ngram():
    h = [7, 2, 8, 9, 3, 2, 5, 9, 3, 2]
    assert propose(h, 1, 3, 1) == [5]  # [9, 3, 2] occurred at 3..5, then 5
    assert propose(h, 1, 1, 1) == [5]  # [2] most recently at 5 -> 5; never [8]


def test_propose_returns_nothing_without_a_match_or_room():
    assert propose([1, 2, 3, 4], 1, 3, 4) == []
    assert propose([1, 2, 3, 1, 2], 3, 3, 4) == []  # needs a 3-gram, none repeats
    assert propose([4], 1, 3, 4) == []
    assert propose([], 1, 3, 4) == []


def test_propose_caps_at_k_and_at_the_end_of_history():
    assert propose([1, 2, 3, 4, 5, 1], 1, 2, 2) == [2, 3]
    assert propose([1, 2, 1], 1, 2, 8) == [2, 1]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# -- engine ---------------------------------------------------------------------------

PATTERN = [ord(c) for c in "abcab"]


def markov_logits(hist: list[int]) -> np.ndarray:
    """A fixed distribution per last token: repetitive enough for lookup to draft."""
    row = np.full(N_VOCAB, -30.0, np.float32)
    last = hist[-1]
    nxt = PATTERN[(PATTERN.index(last) + 1) % len(PATTERN)] if last in PATTERN else PATTERN[0]
    row[nxt] = 3.0
    row[ord("x")] = 2.0
    row[ord("y")] = 1.0
    row[EOS] = -30.0
    return row


def run(lookup, sampling, prompt="abcabcab", max_tokens=12, stop=None, n_ctx=128):
    if lookup is True:  # the scripted backend's timings mean nothing: fixed row cost
        lookup = LookupConfig(measure_cost=False, cost_per_draft=0.2)
    be = ScriptedBackend(logits_fn=markov_logits, n_ctx=n_ctx)
    eng = Engine(be)
    events = list(eng.generate(prompt, sampling=sampling, max_tokens=max_tokens, stop=stop, lookup=lookup))
    return events, be


def test_greedy_output_is_identical_with_and_without_lookup():
    on, be_on = run(True, GREEDY, max_tokens=30)
    off, be_off = run(False, GREEDY, max_tokens=30)
    assert [t for e in on for t in e.tokens] == [t for e in off for t in e.tokens]
    assert on[-1].timings.accepted > 10
    assert len(be_on.calls) < len(be_off.calls)  # fewer backend steps: it paid


def test_penalties_see_accepted_drafts_exactly():
    p = SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=8, frequency_penalty=0.3)
    on, _ = run(True, p, max_tokens=25)
    off, _ = run(False, p, max_tokens=25)
    assert "".join(e.text for e in on) == "".join(e.text for e in off)


def test_rejected_drafts_are_trimmed_from_the_kv_cache():
    on, be = run(True, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5), max_tokens=40)
    t = on[-1].timings
    assert t.drafted > t.accepted > 0  # some drafts were rejected...
    # ...and the scripted backend asserts on every decode that the engine's position
    # equals what its KV holds, so a missed trim would have failed the run


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_is_exact_when_a_draft_overshoots(max_tokens):
    on, _ = run(True, GREEDY, max_tokens=max_tokens)
    assert sum(len(e.tokens) for e in on) == max_tokens
    assert on[-1].finish_reason == "length"


def test_stop_string_is_exact_when_a_draft_overshoots():
    on, _ = run(True, GREEDY, max_tokens=30, stop=["bca"])
    off, _ = run(False, GREEDY, max_tokens=30, stop=["bca"])
    assert "".join(e.text for e in on) == "".join(e.text for e in off) == "ca"
    assert on[-1].finish_reason == "stop"


def test_sampled_output_distribution_is_unchanged_by_lookup():
    """Chi-square on the 4th generated token over many seeds, against the exact law.

    With this chain the token after any history is drawn from softmax([3, 2, 1]) over
    {pattern-next, x, y}; the 4th token's law is computed by enumerating histories.
    """
    sampling = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    probs3 = np.exp([3.0, 2.0, 1.0]) / np.exp([3.0, 2.0, 1.0]).sum()
    outcomes: dict[str, int] = {}
    draws = 3000
    for seed in range(draws):
        events, _ = run(True, SamplingParams(seed=seed, **sampling), max_tokens=4)
        toks = [t for e in events for t in e.tokens]
        key = chr(toks[3])
        outcomes[key] = outcomes.get(key, 0) + 1
    # exact law of token 4: p(x) and p(y) are fixed; the rest goes to pattern letters
    assert outcomes.get("x", 0) + outcomes.get("y", 0) + sum(v for k, v in outcomes.items() if k in "abc") == draws
    counts = np.array([outcomes.get("x", 0), outcomes.get("y", 0), draws - outcomes.get("x", 0) - outcomes.get("y", 0)])
    assert chi_square(counts, np.array([probs3[1], probs3[2], probs3[0]])) < 13.82  # df=2, 99.9%


@pytest.mark.parametrize("params", [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.8, top_k=2, xtc_probability=0.5, xtc_threshold=0.05),
    dict(mirostat=2, mirostat_tau=1.0, temperature=1.0),
    dict(temperature=0.9, repeat_penalty=1.3, dry_multiplier=0.5),
])
def test_sampled_output_is_the_same_tokens_with_and_without_lookup(params):
    for seed in range(20):
        on, _ = run(True, SamplingParams(seed=seed, **params), max_tokens=24)
        off, _ = run(False, SamplingParams(seed=seed, **params), max_tokens=24)
        assert [t for e in on for t in e.tokens] == [t for e in off for t in e.tokens]


def test_controller_measures_step_cost():
    c = DraftController(LookupConfig(cost_per_draft=0.1))
    for _ in range(5):
        c.observe_step(0, 10.0)
    for _ in range(20):
        c.observe_step(4, 50.0)  # every extra row costs a whole plain step
    assert abs(c.row_cost - 1.0) < 0.05
    c.rate = 0.6  # at that cost, 60% acceptance cannot pay
    assert c.draft_length() == 0


def test_controller_turns_off_when_drafts_fail_and_probes_again():
    c = DraftController(LookupConfig(cooldown_steps=3, measure_cost=False))
    assert c.draft_length() > 0
    for _ in range(6):
        c.record(4, 0, 1)
    assert c.draft_length() == 0  # stopped paying: cooldown starts
    assert [c.draft_length() for _ in range(3)] == [0, 0, 0]
    assert c.draft_length() > 0  # probes again


def test_controller_lengthens_drafts_when_they_are_accepted():
    c = DraftController(LookupConfig(measure_cost=False))
    short = c.draft_length()
    for _ in range(10):
        c.record(8, 8, 9)
    assert c.draft_length() > short


def test_disabled_lookup_never_drafts():
    on, be = run(False, GREEDY, max_tokens=20)
    assert all(len(e.tokens) == 1 for call in be.calls[1:] for e in call)
    assert on[-1].timings.drafted == 0

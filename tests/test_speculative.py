"""Prompt-lookup speculation: the proposer on literal arrays, exactness of verification
(identity at temperature 0, unchanged distribution under sampling), state and limits."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from localrun.speculation import lookup as speculative
from localrun.engine import Engine
from localrun.sampling import SamplingParams
from localrun.speculation.drift import BatchDrift
from localrun.speculation.proposer import ALONE, Proposer, StepShare
from localrun.speculation.lookup import Acceptance, LookupConfig, LookupProposer, NgramIndex, StepCost, propose

from fakes import EOS, N_VOCAB, ScriptedBackend

GREEDY = SamplingParams(temperature=0)


# -- proposer -------------------------------------------------------------------------


def test_propose_takes_what_followed_the_most_recent_match():
    assert propose([5, 6, 7, 9, 5, 6], 2, 3) == [7, 9, 5]
    # two earlier occurrences of [1, 2], equally long matches: the most recent one (then 4) wins
    assert propose([1, 2, 3, 1, 2, 4, 1, 2], 2, 1) == [4]


def test_propose_prefers_the_longest_match_over_the_most_recent():
    h = [9, 3, 2, 5, 0, 3, 2, 8, 9, 3, 2]
    # [3, 2] ended at 2 and at 6; at 2 it extends backwards to [9, 3, 2] (3 tokens), at 6 not
    assert propose(h, 2, 1) == [5]
    draft, match = NgramIndex().find(h, 1)
    assert (draft, match) == ([5], 3)


def test_propose_returns_nothing_without_a_long_enough_match():
    assert propose([1, 2, 3, 4], 2, 4) == []
    assert propose([1, 2, 3, 1, 2], 3, 4) == []  # only a 2-token match
    assert propose([1, 2], 2, 4) == []
    assert propose([], 2, 4) == []


def test_propose_caps_at_k_and_at_the_end_of_history():
    assert propose([1, 2, 3, 4, 5, 1, 2], 2, 2) == [3, 4]
    assert propose([1, 2, 1, 2], 2, 8) == [1, 2]  # overlapping the tail is fine: a repeat


def test_index_follows_a_growing_history():
    idx, h = NgramIndex(), [4, 5, 6]
    assert idx.find(h, 4) == ([], 0)
    h += [7, 4, 5]
    assert idx.find(h, 4) == ([6, 7, 4, 5], 2)
    h += [6]  # the match grows to [4, 5, 6]
    assert idx.find(h, 2) == ([7, 4], 3)


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
    eng.speculator.drift = BatchDrift.known(0.0)  # a scripted row never depends on the batch it is in
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


class DriftingBackend(ScriptedBackend):
    """Rows of a wide step stray from one-row steps' (as llama.cpp's do on some models):
    there the runner-up 'x' gains 0.1, which flips the near-tie that follows every 'c'."""

    def decode(self, batch):
        rows = super().decode(batch)
        for e, r in zip(batch, rows):
            if len(e.tokens) > 1:
                r[:, ord("x")] += 0.1
        return rows


def near_tie_logits(hist: list[int]) -> np.ndarray:
    row = markov_logits(hist)
    if hist[-1] == ord("c"):
        row[ord("x")] = 2.95  # 'a' leads by 0.05 alone, loses by 0.05 in a wide step
    return row


def test_greedy_is_identical_when_wide_rows_drift():
    def greedy(lookup, backend_type):
        be = backend_type(logits_fn=near_tie_logits, n_ctx=256)
        eng = Engine(be)
        out = eng.complete("abcabcab", sampling=GREEDY, max_tokens=60, lookup=lookup)
        return out, eng

    off, _ = greedy(False, ScriptedBackend)
    on, eng = greedy(LookupConfig(measure_cost=False, cost_per_draft=0.2, exact_greedy=True), DriftingBackend)
    assert "x" not in off.text
    assert on.tokens == off.tokens
    assert on.timings.accepted > 10 and on.timings.steps < off.timings.steps  # it still paid
    assert not eng.speculator.drift.calibrating and eng.speculator.drift.worst == pytest.approx(0.1, abs=1e-5)
    # without the margin rule (the default) a wide row decides the tie the other way
    eng.backend.kv_clear(0)
    unruled = eng.complete("abcabcab", sampling=GREEDY, max_tokens=60,
                           lookup=LookupConfig(measure_cost=False, cost_per_draft=0.2))
    assert unruled.tokens != off.tokens


def test_by_default_greedy_lookup_takes_wide_rows_as_they_come_and_measures_no_drift():
    be = DriftingBackend(logits_fn=near_tie_logits, n_ctx=256)
    eng = Engine(be)
    out = eng.complete("abcabcab", sampling=GREEDY, max_tokens=60,
                       lookup=LookupConfig(measure_cost=False, cost_per_draft=0.2))
    assert out.timings.accepted > 10
    assert eng.speculator.drift.calibrating  # no row was decoded a second time to measure the drift
    assert len(be.calls) == 1 + out.timings.steps  # the prompt, then one decode per step: none redone


def test_a_row_left_to_a_one_row_step_counts_against_the_draft():
    """Rows after a row too close to call are thrown away, as after a rejection: drafting
    must learn that, or it keeps drafting long where every draft stops early."""
    be = DriftingBackend(logits_fn=near_tie_logits, n_ctx=512)
    eng = Engine(be)
    verdicts = []
    judged = eng.speculator.acceptance.judged
    eng.speculator.acceptance.judged = lambda band, drafted, accepted: (verdicts.append((drafted, accepted)),
                                                             judged(band, drafted, accepted))
    out = eng.complete("abcabcab", sampling=GREEDY, max_tokens=150,
                       lookup=LookupConfig(measure_cost=False, cost_per_draft=0.2, exact_greedy=True))
    assert "x" not in out.text and not eng.speculator.drift.calibrating
    # no draft token here differs from the greedy one, yet the stops count as rejections
    assert any(accepted < drafted for drafted, accepted in verdicts)
    assert all(accepted == drafted or accepted + 1 == drafted for drafted, accepted in verdicts)


def test_controller_drafts_only_what_pays_at_the_measured_cost():
    cost = StepCost()
    for _ in range(10):
        cost.observe(1, 10.0)
        for rows in range(2, 6):
            cost.observe(rows, 12.0 * rows - 2.0)  # every extra row costs more than a plain step
    c = LookupProposer(LookupConfig(), cost)
    assert c.best_length(0.6, 4) == 0  # at that cost, 60% acceptance cannot pay
    assert c.best_length(0.99, 4) == 0  # nor can 99%: 1.99 tokens for 2.2 steps
    cheap = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.1))
    assert cheap.best_length(0.8, 8) > 2


def test_where_a_longer_draft_pays_barely_more_the_shorter_is_taken():
    # SmolLM2 on this CPU: a row costs ~0.45 one-row steps, so past ~20 tokens a longer
    # draft is expected to pay 1-2% more while a departure in it loses every row after it.
    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.45))

    def gain(k: int, rate: float = 0.999) -> float:
        return sum(rate ** i for i in range(k + 1)) / c.row_cost(k + 1)

    most = max(range(49), key=gain)
    assert most == 48  # the gain still rises to the longest draft...
    k = c.best_length(0.999, 48)
    assert 16 <= k < 40  # ...but a far shorter one is taken
    assert gain(k) >= speculative.NEAR_BEST * gain(most) > gain(k - 1)  # the shortest one that pays nearly as much
    steep = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.01))
    assert steep.best_length(0.999, 48) >= 44  # where each token adds more, the draft stays long


def test_longer_matches_draft_longer():
    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.25))
    copy = list(range(100, 140))
    long_match = copy + [1] + copy[:20]  # the tail repeats 20 tokens of an earlier span
    short_match = [7, 8, 1, 2, 3, 9, 4, 5, 6, 2, 3]  # [2, 3] once before, then 9
    assert len(c.draft(long_match, 16)) > 4
    assert c.draft(short_match, 16) == []  # a 2-token match does not pay at this cost


def test_a_band_that_stopped_paying_comes_back_when_plain_steps_copy_again():
    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.25))
    copy = list(range(100, 200))
    h = copy + [1] + copy[:20]  # a 20-token match: copying on keeps it in the longest band
    tries = 0
    while c.draft(h, 8):  # every draft in this band rejected at once...
        c.record(4, 0)
        tries += 1
        assert tries < 20
    assert tries >= 2  # ...until it stopped paying: plain steps from here
    assert [c.draft(h, 8) for _ in range(20)] == [[]] * 20  # nothing new to judge it by
    steps = 0
    while not c.draft(h, 8):  # the answer goes on copying, one plain step a token
        h = h + [copy[len(h) - len(copy) - 1]]
        steps += 1
        assert steps < 30
    assert steps >= 4  # a shadow draft is judged only once the tokens it named came


def test_shadow_drafts_that_the_answer_does_not_follow_keep_a_band_quiet():
    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.25))
    copy = list(range(100, 200))
    h = copy + [1] + copy[:20]
    while c.draft(h, 8):
        c.record(4, 0)
    rate = c.rate(speculative._band(20))
    for off in range(20):  # each step the answer leaves the match it was about to copy...
        assert c.draft(h, 8) == []
        h = h + [500 + off] + copy[:20]  # ...and comes back to it later
    assert c.rate(speculative._band(20)) < rate  # the shadows' verdicts were recorded


def test_a_new_generation_starts_from_the_models_record_until_its_own_drafts_fail():
    cfg = LookupConfig(measure_cost=False, cost_per_draft=0.25)
    copy = list(range(100, 200))
    h = copy + [1] + copy[:6]  # a 6-token match
    band = speculative._band(6)
    fresh_start = len(LookupProposer(cfg).draft(h, 48))
    assert fresh_start > 0
    copied, failed = Acceptance(), Acceptance()
    for _ in range(6):
        copied.judged(band, 10, 10)  # a code edit: every draft kept whole
        failed.judged(band, 4, 0)  # a chat: every draft rejected at once
    assert len(LookupProposer(cfg, model=failed).draft(h, 48)) < fresh_start
    after_edits = LookupProposer(cfg, model=copied)
    assert len(after_edits.draft(h, 48)) > fresh_start  # a session of edits goes on copying...
    other = speculative._band(30)
    for _ in range(2):  # ...until this answer's drafts fail (in any band): a chat, then
        after_edits.slot = other
        after_edits.record(4, 0)
    assert after_edits.rate(band) <= Acceptance().rate(band)  # the edits' record no longer lifts it


def test_a_draft_goes_around_a_loop_the_answer_repeats():
    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.01))
    loop = [11, 12, 13, 14]
    h = [1, 2, 3] + loop * 3 + loop[:2]  # the tail has gone around a 4-token loop three times
    assert c.draft(h, 10) == (loop[2:] + loop * 2)[:10]  # not just the 3 tokens up to the end
    once = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.01))
    phrase = list(range(20, 40))
    h = [1, 2, 3] + phrase + [9] + phrase  # a 20-token phrase, repeated once
    draft = once.draft(h, 30)
    assert 0 < len(draft) <= 21 and draft == ([9] + phrase)[:len(draft)]  # stops where the history ends


def test_a_phrase_the_answer_repeats_drafts_shorter_than_a_copy_of_the_prompt():
    cfg = LookupConfig(measure_cost=False, cost_per_draft=0.05)
    phrase = list(range(100, 140))
    h = [1, 2] + phrase + [3] + phrase[:10]  # 10 tokens agree with an earlier 40-token span
    copying = LookupProposer(cfg, answer_start=len(h) - 10).draft(h, 30)  # the span is in the prompt
    repeating = LookupProposer(cfg, answer_start=1).draft(h, 30)  # the span is the answer's own
    assert copying == phrase[10:10 + len(copying)] and repeating == phrase[10:10 + len(repeating)]
    assert 0 < len(repeating) < len(copying)
    loop = [11, 12, 13, 14]
    h = [1, 2, 3] + loop * 3 + loop[:2]
    cheap = LookupConfig(measure_cost=False, cost_per_draft=0.01)  # where every drafted token pays
    assert len(LookupProposer(cheap, answer_start=1).draft(h, 10)) == 10  # a loop goes on as a copy does


def test_the_answers_own_phrases_keep_an_acceptance_apart_from_copies_of_the_prompt():
    """A model whose code edits copied well may still leave its own loops mid-lap (SmolLM2
    on an open chat): what copies did must not price the answer's own phrases."""
    cfg = LookupConfig(measure_cost=False, cost_per_draft=0.25)
    prompt, sentence = [1, 2, 3], list(range(100, 108))
    lap = prompt + sentence * 2 + sentence[:4]  # 12 tokens into saying an 8-token sentence again

    def drafted(model: Acceptance, answer_start: int) -> list[int]:
        return LookupProposer(cfg, model=model, answer_start=answer_start).draft(lap, 48)

    own = drafted(Acceptance(), len(prompt))
    assert own == (sentence[4:] + sentence)[:len(own)] and own  # the answer's own phrase, repeated
    copy = drafted(Acceptance(), len(lap) - 4)  # the same tokens, as a copy of the prompt
    edits, loops_kept, loops_left = Acceptance(), Acceptance(), Acceptance()
    for _ in range(20):
        edits.judged(speculative._slot(12, own=False), 20, 20)  # code edits: every copy kept
        loops_kept.judged(speculative._slot(12, own=True), 20, 20)  # a poem that went round its stanza
        loops_left.judged(speculative._slot(12, own=True), 4, 0)  # chats: every repeat left at once
    assert drafted(edits, len(prompt)) == own  # the edits' record does not lift a repeat...
    assert len(drafted(edits, len(lap) - 4)) > len(copy)  # ...only copies
    assert drafted(loops_kept, len(prompt)) == own  # nor do earlier answers' repeats
    assert drafted(loops_left, len(prompt)) == []  # repeats that failed lower it (and copies are
    assert len(drafted(loops_left, len(lap) - 4)) < len(copy)  # priced by every draft of their length)


def test_a_later_generation_that_copies_drafts_again_where_the_model_failed_before():
    cfg = LookupConfig(measure_cost=False, cost_per_draft=0.25)
    copy = list(range(100, 200))
    model = Acceptance()
    band = speculative._band(20)
    for _ in range(30):  # earlier answers whose drafts in this band were all rejected
        model.judged(band, 4, 0)
    before = model.rate(band)
    later = LookupProposer(cfg, model=model)
    h = copy + [1] + copy[:20]  # a 20-token match
    assert [later.draft(h, 8) for _ in range(40)] == [[]] * 40  # the model's record speaks against it...
    steps = 0
    while not later.draft(h, 8):  # ...until this answer's plain steps show it copying
        h = h + [copy[len(h) - len(copy) - 1]]
        steps += 1
        assert steps < 40
    assert model.rate(band) > before  # and the model learnt it too


def test_after_a_kept_draft_the_copy_goes_on_where_it_was_even_behind_a_common_pair():
    # Code repeats a pair such as (`last`, `_ts`) more often than the CANDIDATES most
    # recent places reach back: the copy the answer was making must still be found.
    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.01))
    pair = [7, 8]
    source = list(range(100, 120)) + pair + list(range(200, 240))
    source += [n for i in range(2 * speculative.CANDIDATES) for n in (50 + i, *pair, 60 + i)]  # the pair, often
    h = source + [1] + list(range(100, 112))  # the answer copies the source's start...
    draft = c.draft(h, 9)
    assert draft == list(range(112, 120)) + [7]
    c.record(len(draft), len(draft))  # ...all kept, and the step's own token copies on too
    h += draft + [8]
    assert NgramIndex().find(h, 4)[1] == 2  # the most recent places alone give a 2-token match
    assert c.draft(h, 10)[:3] == [200, 201, 202]


def test_a_draft_stops_before_the_templates_control_tokens():
    question, end_turn, start_turn = list(range(100, 120)), 900, 901
    history = question + [end_turn, start_turn] + question[:12]  # the answer echoes the question
    cheap = LookupConfig(measure_cost=False, cost_per_draft=0.01)
    assert LookupProposer(cheap).draft(history, 32)[:9] == question[12:] + [end_turn]
    held = LookupProposer(cheap, control=frozenset({end_turn, start_turn}))
    assert held.draft(history, 32) == question[12:]  # the echo's end, not the turn's


def test_the_engine_never_drafts_a_control_token_of_the_prompt():
    control = EOS  # the scripted backend's one control token (a turn's end, in a chat prompt)
    prompt = [ord(c) for c in "abcab"] + [control] + [ord(c) for c in "ab"]
    be = ScriptedBackend(logits_fn=markov_logits, n_ctx=128)
    eng = Engine(be)
    eng.speculator.drift = BatchDrift.known(0.0)
    events = list(eng.generate(prompt, sampling=GREEDY, max_tokens=20,
                               lookup=LookupConfig(measure_cost=False, cost_per_draft=0.2)))
    assert events[-1].timings.drafted > 0  # it drafted the pattern...
    assert all(control not in e.tokens for call in be.calls[1:] for e in call)  # ...never the control token


def test_controller_lengthens_drafts_when_they_are_accepted():
    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.25))
    copy = list(range(100, 140))
    h = copy + [1] + copy[:3]  # a 3-token match: prior 0.5
    short = len(c.draft(h, 32))
    for _ in range(10):
        c.draft(h, 32)
        c.record(8, 8)
    assert len(c.draft(h, 32)) > short


def test_disabled_lookup_never_drafts():
    on, be = run(False, GREEDY, max_tokens=20)
    assert all(len(e.tokens) == 1 for call in be.calls[1:] for e in call)
    assert on[-1].timings.drafted == 0


class BufferBackend(DriftingBackend):
    """Rows live in one buffer that every decode overwrites from its start, as llama.cpp's
    do; the last entry's rows come first there (llama.cpp orders them by its own rule)."""

    buffer = np.zeros((64, N_VOCAB), np.float32)

    def decode(self, batch):
        rows = super().decode(batch)
        out, at = [None] * len(rows), 0
        for i in reversed(range(len(rows))):
            self.buffer[at : at + len(rows[i])] = rows[i]
            out[i] = self.buffer[at : at + len(rows[i])]
            at += len(rows[i])
        return out


def cycle_or_walk(hist: list[int]) -> np.ndarray:
    """A prompt starting with 'a' repeats the near-tie cycle (lookup drafts it); any other
    walks through tokens that depend on its whole history (a clobbered row shows)."""
    if hist[0] == ord("a"):
        return near_tie_logits(hist)
    row = np.full(N_VOCAB, -30.0, np.float32)
    row[40 + (sum(hist) * 31 + len(hist)) % 80] = 3.0
    return row


def test_calibrating_one_generation_leaves_the_others_rows_intact():
    """Two greedy generations in one step while the batch drift is being measured: the
    re-decoding for one must not clobber the rows the other reads next."""
    prompts = ["abcabcab", "zyx"]
    solo = []
    for p in prompts:
        eng = Engine(ScriptedBackend(logits_fn=cycle_or_walk, n_ctx=256))
        solo.append(eng.complete(p, sampling=GREEDY, max_tokens=40, lookup=False).tokens)
    eng = Engine(BufferBackend(logits_fn=cycle_or_walk, n_ctx=256, n_seq=2))
    lookup = LookupConfig(measure_cost=False, cost_per_draft=0.2, exact_greedy=True)
    # the second one steps plainly: it reads its one row after the first one re-decoded
    gens = [eng.start(p, sampling=GREEDY, max_tokens=40, lookup=lk) for p, lk in zip(prompts, [lookup, False])]
    while not all(g.done for g in gens):
        eng.step(gens)
    assert [g.output for g in gens] == solo
    assert gens[0].timings.accepted > 0


def test_a_measured_drift_is_remembered_for_the_same_model_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_CACHE", str(tmp_path / "data"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")

    def engine():
        be = DriftingBackend(logits_fn=near_tie_logits, n_ctx=256)
        be.info = dataclasses.replace(be.info, path=str(model))
        return Engine(be)

    first = engine()
    assert first.speculator.drift.calibrating  # never measured for this file
    first.complete("abcabcab", sampling=GREEDY, max_tokens=80,
                   lookup=LookupConfig(measure_cost=False, cost_per_draft=0.2, exact_greedy=True))
    assert not first.speculator.drift.calibrating
    again = engine()
    assert not again.speculator.drift.calibrating and again.speculator.drift.worst == pytest.approx(first.speculator.drift.worst)
    os.utime(model, ns=(1, 1))  # the same bytes touched, or copied elsewhere: the same model
    assert not engine().speculator.drift.calibrating
    model.write_bytes(b"other weights")  # another file now (a re-quantize): measure again
    assert engine().speculator.drift.calibrating
    (tmp_path / "data" / "batch-drift.json").write_text("{not json")  # a damaged cache: measure again
    assert engine().speculator.drift.calibrating


# -- the proposer seam ----------------------------------------------------------------


class _Guesser(Proposer):
    """A proposer that is not prompt lookup: it guesses the pattern's next tokens, wrong
    on every third call, and keeps what the engine tells it."""

    def __init__(self) -> None:
        self.calls, self.verdicts, self.released = 0, [], 0

    def draft(self, history, room, share=ALONE):
        self.calls += 1
        at = PATTERN.index(history[-1]) + 1 if history[-1] in PATTERN else 0  # markov_logits' likeliest path
        nxt = [PATTERN[(at + i) % len(PATTERN)] for i in range(min(3, room))]
        return [ord("y")] + nxt[1:] if self.calls % 3 == 0 else nxt

    def record(self, judged, accepted):
        self.verdicts.append((judged, accepted))

    def release(self):
        self.released += 1


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=9)])
def test_any_proposer_behind_the_seam_is_verified_exactly(sampling):
    """The engine drafts from whatever Proposer a generation holds, keeps a draft only
    where it is the token sampling gives, tells the proposer what was kept, and releases
    it when the generation ends: the output is the one without drafts."""
    off, _ = run(False, sampling, max_tokens=30)
    be = ScriptedBackend(logits_fn=markov_logits, n_ctx=128)
    eng = Engine(be)
    gen = eng.start("abcabcab", sampling=sampling, max_tokens=30, lookup=False)
    guesser = gen.proposer = _Guesser()
    tokens = []
    while not gen.done:
        ev = eng.step([gen]).get(gen.seq)
        tokens += ev.tokens if ev is not None else []
    assert tokens == [t for e in off for t in e.tokens]
    assert guesser.verdicts and any(a > 0 for _, a in guesser.verdicts)  # some drafts were kept
    assert any(a < j for j, a in guesser.verdicts)  # and the wrong guesses were not
    assert gen.timings.accepted == sum(a for _, a in guesser.verdicts)
    assert guesser.released >= 1  # the generation's end gave its proposer back
    assert len(be.calls) < 30  # fewer backend steps than tokens: the kept drafts paid


def test_a_draft_that_pays_alone_does_not_pay_in_a_step_four_streams_share():
    """A k-token draft widens the whole step: with four streams decoding together, every
    one of them waits for its rows, so the draft must add more than it slows them by
    (StepShare). At a 50% acceptance and a quarter step a row, one stream drafts; four
    streams sharing a step do not; at 95% they still do."""
    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.25))
    assert c.best_length(0.5, 8) > 0
    assert c.best_length(0.5, 8, share=StepShare(rows=1, tokens=1)) == c.best_length(0.5, 8)  # alone, as before
    assert c.best_length(0.5, 8, share=StepShare(rows=4, tokens=4)) == 0
    assert c.best_length(0.95, 8, share=StepShare(rows=4, tokens=4)) > 0
    # a step wide with another stream's prompt chunk makes a draft's rows cheap by comparison
    assert c.best_length(0.5, 8, share=StepShare(rows=200, tokens=1)) >= c.best_length(0.5, 8)


def test_the_engine_prices_each_draft_in_the_step_it_joins():
    """Two generations decoding together: each proposer hears a step of two rows and two
    tokens, the second one also the first one's draft rows."""
    be = ScriptedBackend(logits_fn=markov_logits, n_ctx=128, n_seq=2)
    eng = Engine(be)
    gens = [eng.start("abcabcab", sampling=GREEDY, max_tokens=12, lookup=False) for _ in range(2)]
    eng.step(gens)  # both read their prompts
    heard = []

    class Listener(_Guesser):
        def draft(self, history, room, share=ALONE):
            heard.append(share)
            return super().draft(history, room, share)

    for g in gens:
        g.proposer = Listener()
    eng.step(gens)
    first, second = sorted(gens, key=lambda g: g.seq)
    assert (heard[0].rows, heard[0].tokens, heard[0].me) == (2, 2, first.seq)
    assert heard[1].tokens == 2 and heard[1].rows == 2 + 3  # the first one's three drafted rows
    assert heard[1].me == second.seq and heard[1].counts[first.seq] == 1 + 3 and heard[1].counts[second.seq] == 1
    assert heard[1].split == be.passes  # the backend says how its passes go

"""The drafts of a step several decoding streams share, chosen together
(speculation.shared_step): on llama.cpp's passes over neighbouring sequences a lone
draft is a pass of its own and never pays, while neighbours drafting the same length
share one pass; a stream with nothing to copy between copying ones carries filler so
they still share one; the streams that gain least are not slowed past MAX_SLOWDOWN; the
engine's shared steps carry those drafts and still give lookup-off's output."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from localrun.backends.base import BatchEntry, neighbour_passes
from localrun.engine import Engine
from localrun.speculation.lookup import LookupConfig, LookupProposer
from localrun.speculation.proposer import MAX_SLOWDOWN, Offer, StepShare
from localrun.speculation.shared_step import choose, filler
from localrun.speculation.speculator import Speculator

from fakes import N_VOCAB, ScriptedBackend
from test_speculative import GREEDY, markov_logits

QUARTER = [1.0] + [1.0 + 0.25 * (r - 1) for r in range(1, 200)]  # a row costs a quarter step


def offer(rate: float, n: int = 12) -> Offer:
    return Offer(list(range(n)), LookupProposer.expected_tokens(rate, n), 1.05, lambda most: QUARTER[: most + 1])


def plain_share(counts: tuple[int, ...], split=neighbour_passes) -> StepShare:
    decoding = sum(1 for n in counts if n == 1)
    return StepShare(sum(counts), decoding, counts, -1, split, sum(counts), counts)


def test_neighbours_that_all_copy_draft_together_where_each_alone_would_not():
    """Two streams, both 95% sure of their next tokens: asked in turn, each sees its draft
    as a pass of its own and drafts nothing; chosen together, both draft one length and
    share one pass, which pays."""
    share = plain_share((1, 1))
    alone = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.25))
    assert alone.best_length(0.95, 12, share=StepShare(2, 2, (1, 1), 0, neighbour_passes, 2, (1, 1))) == 0
    lengths = choose({0: offer(0.95), 1: offer(0.95)}, share, room=30)
    assert lengths[0] == lengths[1] > 0
    assert neighbour_passes([1 + lengths[0], 1 + lengths[1]]) == [2 + 2 * lengths[0]]  # one pass
    cost = share.cost_with(QUARTER, lengths)
    assert cost <= MAX_SLOWDOWN * offer(0.95).expected[lengths[0]] * share.cost_with(QUARTER, {})


def test_streams_with_nothing_to_copy_bound_what_the_drafts_cost():
    """Four streams in one pass, two of them copying: the copiers draft, but the step
    stays within MAX_SLOWDOWN of its plain cost, since the other two get one token from
    it (here the bound is what stops them: a longer draft would pay more). On
    llama.cpp's split the copiers' drafts would need a pass of their own, which does
    not pay: nothing is drafted."""
    assert choose({0: offer(0.95), 1: offer(0.95)}, plain_share((1, 1, 1, 1)), room=30) == {0: 0, 1: 0}
    share = plain_share((1, 1, 1, 1), split=None)
    lengths = choose({0: offer(0.95), 1: offer(0.95)}, share, room=30)
    assert lengths[0] == lengths[1] > 0
    assert share.cost_with(QUARTER, lengths) <= MAX_SLOWDOWN * share.cost_with(QUARTER, {})
    unbounded = {0: lengths[0] + 1, 1: lengths[1] + 1}
    assert share.cost_with(QUARTER, unbounded) > MAX_SLOWDOWN * share.cost_with(QUARTER, {})
    tokens = [4 + 2 * (offer(0.95).expected[k] - 1) for k in (lengths[0], unbounded[0])]
    assert tokens[1] / share.cost_with(QUARTER, unbounded) > tokens[0] / share.cost_with(QUARTER, lengths)


def test_a_stream_whose_offer_would_drag_the_step_drafts_nothing():
    """In one pass (split=None), a stream unlikely to keep its draft only adds rows: it
    plans a plain step while its likely neighbour drafts."""
    share = StepShare(2, 2, (1, 1), -1, None, 2, (1, 1))
    lengths = choose({0: offer(0.95), 1: offer(0.05)}, share, room=30)
    assert lengths[0] > 0 and lengths[1] == 0


def test_drafts_that_do_not_pay_and_drafts_past_the_room_are_not_taken():
    share = plain_share((1, 1))
    assert choose({0: offer(0.2), 1: offer(0.2)}, share, room=30) == {0: 0, 1: 0}
    lengths = choose({0: offer(0.99, 40), 1: offer(0.99, 40)}, share, room=6)
    assert sum(lengths.values()) <= 6 and min(lengths.values()) > 0
    assert choose({}, share, room=6) == {}


def together_and_alone(prompts: list[str], logits_fn, cost_per_draft: float):
    """Greedy generations of `prompts` with lookup, in slots 0.. of one engine on a backend
    that batches neighbours only, stepped together to the end, each answer checked against
    the one its prompt gives alone with lookup off: (the generations, that backend)."""
    def backend() -> ScriptedBackend:
        return ScriptedBackend(logits_fn=logits_fn, n_ctx=256, n_seq=len(prompts), batches_neighbours_only=True)

    solo = [Engine(backend()).complete(p, sampling=GREEDY, max_tokens=40, lookup=False).tokens for p in prompts]
    be = backend()
    eng = Engine(be)
    cfg = LookupConfig(measure_cost=False, cost_per_draft=cost_per_draft)
    gens = [eng.start(p, sampling=GREEDY, max_tokens=40, lookup=cfg) for p in prompts]
    assert [g.seq for g in gens] == list(range(len(prompts)))
    while not all(g.done for g in gens):
        eng.step([g for g in gens if not g.done])
    assert [g.output for g in gens] == solo
    return gens, be


def test_two_copying_streams_draft_in_the_same_step_and_keep_lookup_offs_output():
    """The engine: two greedy generations that copy, on a backend that batches
    neighbours only, both carry drafts in one step, and each answer is the one it gives
    with lookup off."""
    gens, be = together_and_alone(["abcabcabcab", "bcabcabcabca"], markov_logits, 0.25)
    both = [call for call in be.calls if len(call) == 2 and all(len(e.tokens) > 1 and e.n_logits > 1 for e in call)]
    assert both, "no step carried both streams' drafts"
    assert any(len(call[0].tokens) == len(call[1].tokens) for call in both)  # one pass: the same length


def test_a_stream_with_nothing_to_copy_carries_filler_so_its_copying_neighbours_share_one_pass():
    """Slots 0, 2 and 3 copy, slot 1 has no match: on llama.cpp's split their drafts
    would make passes of their own around slot 1's one token (too dear, nothing drafts);
    with slot 1 carrying as many rows of filler the step is one pass, and all four carry
    the same length."""
    share = plain_share((1, 1, 1, 1))
    offers = {0: offer(0.99), 2: offer(0.99), 3: offer(0.99)}
    assert choose(offers, share, room=30) == {0: 0, 2: 0, 3: 0}
    lengths = choose(offers, share, room=30, fillable={1: 12})
    assert set(lengths) == {0, 1, 2, 3} and len(set(lengths.values())) == 1 and lengths[1] > 0
    counts = [1 + lengths[s] for s in range(4)]
    assert len(neighbour_passes(counts)) == 1
    assert share.cost_with(QUARTER, lengths) <= MAX_SLOWDOWN * share.cost_with(QUARTER, {})


def test_filler_is_never_carried_where_it_cannot_merge_passes():
    """Where every sequence is its own pass (MLX) or the step is one pass whatever its
    counts, filler only adds rows: the copiers draft without it."""
    mlx_split = lambda counts: [n for n in counts if n]  # noqa: E731 - MlxBackend.passes
    for split in (mlx_split, None):
        share = plain_share((1, 1, 1, 1), split=split)
        lengths = choose({0: offer(0.99), 2: offer(0.99), 3: offer(0.99)}, share, room=30, fillable={1: 12})
        assert lengths.get(1, 0) == 0 and lengths[0] > 0


def test_filler_guesses_what_followed_the_last_token_before():
    assert filler([5, 6, 7, 9, 5], 3) == [6, 7, 9]
    assert filler([5, 6, 5], 4) == [6, 5, 5, 5]  # the history ends: the last token again
    assert filler([1, 2, 3], 2) == [3, 3]  # never seen before


def never_repeats_after_z(hist: list[int]) -> np.ndarray:
    """After a prompt starting with "z", a token sequence with no pair twice in 200
    tokens (nothing for prompt lookup to copy); the Markov pattern otherwise."""
    if hist[0] != ord("z"):
        return markov_logits(hist)
    row = np.full(N_VOCAB, -30.0, np.float32)
    row[32 + (len(hist) * 37) % 200] = 3.0
    return row


def test_a_stream_that_cannot_copy_carries_filler_between_copiers_and_keeps_lookup_offs_output():
    """The engine: four greedy generations, the one in slot 1 with nothing to copy, on a
    backend that batches neighbours only. Steps carry the copiers' drafts in one pass
    with filler in slot 1; every answer is the one it gives with lookup off, and the
    filler counts as no draft of slot 1's."""
    gens, be = together_and_alone(["abcabcabcab", "zq", "bcabcabcabca", "cabcabcabcab"], never_repeats_after_z, 0.1)
    filled = [call for call in be.calls if len(call) == 4 and len({len(e.tokens) for e in call}) == 1
              and len(call[1].tokens) > 1]
    assert filled, "no step carried filler in slot 1 beside its neighbours' drafts"
    assert all(len(neighbour_passes([len(e.tokens) for e in call])) == 1 for call in filled)
    assert gens[1].timings.drafted == 0 and all(g.timings.drafted > 0 for g in gens[::2])


def test_a_shared_step_prices_the_next_drafts_only_when_it_is_one_pass_of_decoding_rows():
    """Two streams drafting one length are one pass of 6 rows, timed as that width; a step
    split into passes, one with a prompt chunk (rows without logits), or one shared by
    streams that never draft is not timed."""
    speculator = Speculator(ScriptedBackend(n_seq=4, batches_neighbours_only=True))
    seen = []
    speculator.step_cost.observe = lambda rows, ms, drafting=True: seen.append((rows, ms, drafting))
    copying, plain = SimpleNamespace(decoding=True, proposer=object()), SimpleNamespace(decoding=True, proposer=None)
    reading = SimpleNamespace(decoding=False, proposer=None)
    speculator.observe([BatchEntry(0, [1, 2, 3], 9, 3), BatchEntry(1, [4, 5, 6], 9, 3)], [copying, plain], 30.0)
    assert seen == [(6, 30.0, True)]
    speculator.observe([BatchEntry(0, [1, 2, 3], 9, 3), BatchEntry(1, [4], 9, 1)], [copying, plain], 30.0)  # 2 passes
    speculator.observe([BatchEntry(0, [1], 9, 1), BatchEntry(1, [4, 5, 6], 0, 0)], [plain, reading], 30.0)
    speculator.observe([BatchEntry(0, [1], 9, 1), BatchEntry(1, [4], 9, 1)], [plain, plain], 30.0)  # nobody drafts
    assert seen == [(6, 30.0, True)]
    speculator.observe([BatchEntry(2, [7], 9, 1)], [plain], 12.0)  # one sequence's one row, as ever
    assert seen[-1] == (1, 12.0, False)

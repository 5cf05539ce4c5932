"""A step that several streams share, as the backend runs it: llama.cpp's passes over
neighbouring sequences (backends.base.neighbour_passes), lookup priced by them
(speculation.proposer.StepShare), and what a draft may take of such a step: the budget
the other streams leave, and at most MAX_SLOWDOWN of its cost."""

from __future__ import annotations

import pytest

from localrun.engine import Engine
from localrun.speculation.lookup import LookupConfig, LookupProposer
from localrun.speculation.proposer import ALONE, Proposer, StepShare

from fakes import ScriptedBackend
from test_speculative import GREEDY, PATTERN, markov_logits


@pytest.mark.parametrize("counts, passes", [
    ([1, 1, 1, 1], [4]),
    ([1, 9, 1, 1], [4, 8]),  # a lone draft: a pass of its own
    ([1, 9, 9, 1], [4, 16]),  # neighbours' drafts of one length share it
    ([1, 9, 1, 9], [4, 8, 8]),  # drafts apart: a pass each
    ([1, 5, 9, 1], [4, 8, 4]),  # the shorter draft ends the shared pass
    ([0, 5, 0, 3], [5, 3]),
    ([200, 1], [2, 199]),  # a prompt chunk beside a decoding stream
    ([0, 0], []),
])
def test_llama_cpp_splits_a_step_into_passes_of_neighbours(counts, passes):
    """backends.base.neighbour_passes: llama.cpp's split of a step with a KV stream per
    sequence (the same number of tokens from each of a run of consecutive ids)."""
    from localrun.backends.base import neighbour_passes

    assert neighbour_passes(counts) == passes


def test_a_lone_draft_among_streams_is_priced_as_the_pass_it_makes():
    """Four streams decoding, each one token: on llama.cpp a 95%-sure draft from one of
    them is its own pass (c(4) + c(k)), which does not pay, where the same rows in the
    shared pass would; beside a neighbour's draft of the same length it shares that pass
    and pays again. MLX runs each sequence as its own pass."""
    from localrun.backends.base import neighbour_passes
    from localrun.backends.mlx import MLXBackend

    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.25))
    one_pass = StepShare(rows=4, tokens=4)
    split = StepShare(4, 4, (1, 1, 1, 1), 1, neighbour_passes)
    assert c.best_length(0.95, 8, share=one_pass) > 0
    assert c.best_length(0.95, 8, share=split) == 0
    beside = StepShare(4 + 8, 4, (9, 1, 1, 1), 1, neighbour_passes)  # seq 0 drafted 8 already
    assert c.best_length(0.95, 8, share=beside) > 0
    assert MLXBackend.passes([1, 3, 0, 2]) == [1, 3, 2]


def test_the_drafts_of_a_shared_step_make_it_at_most_twice_as_dear_for_the_others():
    """StepShare.widest: a stream that drafts nothing gets one token from the step, so
    the drafts in it may together make it at most MAX_SLOWDOWN times the plain step's
    cost; a stream decoding alone has no such bound. Priced at a quarter step a row."""
    from localrun.backends.base import neighbour_passes
    from localrun.speculation.proposer import MAX_SLOWDOWN

    assert MAX_SLOWDOWN == 2.0
    costs = [1.0] + [1.0 + 0.25 * (r - 1) for r in range(1, 80)]
    assert StepShare().widest(costs, 40) == 40  # alone
    one_pass = StepShare(rows=4, tokens=4, plain_rows=4)  # c(4) = 1.75: up to c(4 + k) = 3.5
    assert one_pass.widest(costs, 40) == 7
    # on llama.cpp a lone draft is a pass of its own: c(4) + c(k) <= 3.5 leaves k <= 4
    split = StepShare(4, 4, (1, 1, 1, 1), 1, neighbour_passes, 4, (1, 1, 1, 1))
    assert split.widest(costs, 40) == 4
    # a neighbour's 4-token draft already in the step: the same length shares its pass
    # (c(4) + c(8) = 4.5 > 3.5), so nothing more fits
    after = StepShare(8, 4, (5, 1, 1, 1), 1, neighbour_passes, 4, (1, 1, 1, 1))
    assert after.widest(costs, 40) == 0
    c = LookupProposer(LookupConfig(measure_cost=False, cost_per_draft=0.25))
    assert c.best_length(0.99, 40, share=one_pass) <= 7 < c.best_length(0.99, 40)


def test_a_draft_never_crowds_another_decoding_stream_out_of_a_tight_step():
    """A server step while streams decode carries a small token budget (StepBudget): the
    first stream's draft takes only what the later streams' tokens leave, so every
    decoding stream advances in every step however long the drafts could be."""
    be = ScriptedBackend(logits_fn=markov_logits, n_ctx=256, n_seq=4)
    eng = Engine(be)
    gens = [eng.start("abcabcab", sampling=GREEDY, max_tokens=40, lookup=False) for _ in range(4)]
    while not all(g.decoding for g in gens):  # all four read their prompts
        eng.step(gens)

    class Greedy(Proposer):  # drafts all the room it is given, the pattern's likeliest path
        def draft(self, history, room, share=ALONE):
            rooms.append(room)
            at = PATTERN.index(history[-1]) + 1 if history[-1] in PATTERN else 0
            return [PATTERN[(at + i) % len(PATTERN)] for i in range(room)]

        def record(self, judged, accepted):
            verdicts.append((judged, accepted))

    rooms: list[int] = []
    verdicts: list[tuple[int, int]] = []
    for g in gens:
        g.proposer = Greedy()
    for _ in range(3):
        calls = len(be.calls)
        events = eng.step(gens, budget=8)
        assert sorted(events) == sorted(g.seq for g in gens)  # nobody waited out the step
        assert sum(len(e.tokens) for e in be.calls[calls]) == 8  # the drafts filled what was left
    assert rooms == [4, 4, 4]  # 8 less its own token and the three later streams' (the rest had no room)
    drafted = [(j, a) for j, a in verdicts if j]  # the streams with no room heard (0, 0)
    assert [j for j, _ in drafted] == [4, 4, 4] and all(a > 0 for _, a in drafted)  # judged whole, partly kept

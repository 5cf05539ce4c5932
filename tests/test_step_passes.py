"""A step that several streams share, as the backend runs it: llama.cpp's passes over
neighbouring sequences (backends.base.neighbour_passes), and lookup priced by them
(speculation.proposer.StepShare)."""

from __future__ import annotations

import pytest

from localrun.speculation.lookup import LookupConfig, LookupProposer
from localrun.speculation.proposer import StepShare


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

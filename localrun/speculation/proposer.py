"""The proposer seam: where a speculative step's draft comes from.

A proposer serves one generation. Each step the speculator asks it for a draft: given
the history (prompt and answer so far) and the room the step has left, up to that many
tokens the model is likely to produce next. The model then scores the pending token and
the draft in one step, the speculator verifies the draft exactly (speculator.py), and
the proposer is told how many of the drafted tokens were judged and how many kept.

A proposer decides how far to draft, because only it knows its odds token by token;
it prices a draft with the model's `StepCost` (what a step of r rows costs, shared by
the model's generations) plus what drafting costs itself: nothing for prompt lookup
(lookup.py), its own decode steps for a draft model. A proposer may hold state beyond
Python objects (a draft model's KV slot, which must follow the kept tokens and be cut
back after a rejection) and gives it back in `release`.

Verification keeps a drafted token while it equals the token the model's own sampling
draws from its row, which is exact for a proposal that is one token for sure (a point
mass): kept with probability p(x), and otherwise p with x removed, renormalised. A
proposer that samples its drafts from a distribution q of its own needs the general
rule (keep x with probability min(1, p(x)/q(x)), else draw from (p - q)+), which comes
with the first such proposer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class StepShare:
    """The step a draft would join, as it is without the draft: the rows it holds (this
    generation's pending token included, other streams' tokens and prompt chunks too)
    and the tokens it yields (one per decoding generation in it). A k-token draft makes
    the step dearer, so it pays only when what it is expected to add beats what it slows
    every stream of the step by: with d decoding streams, C(k) the step's cost with the
    draft, k drafted tokens expected to add E tokens pay when (d + E) / C(k) > d / C(0).
    Alone that is (1 + E) / c(1 + k) > 1, with c(r) the cost of one pass of r rows.

    With other streams in the step, where the draft's rows go depends on the backend:
    llama.cpp (a KV stream per sequence) splits a step into passes that take the same
    number of tokens from each of a run of neighbouring sequences, so a lone draft's
    rows make a pass of their own (c(r) + c(k), not c(r + k): on 4 streams that cost
    lookup ~10% of the server's speed), while drafts of the same length from neighbours
    share one; MLX runs each sequence's rows as a pass. `counts` (the tokens each slot
    feeds, by slot id, this generation's `me` without its draft) and the backend's
    `split` (Backend.passes: the rows of each pass for such counts) say which.

    That rule pays on average over the streams, not for each of them: a stream that does
    not draft gets its one token from a step its neighbours' drafts made several times
    dearer. So the drafts of a shared step may together make it at most MAX_SLOWDOWN
    times as dear as the step without any (`plain_rows`, `plain_counts`: the step as
    planned before the first draft), see `widest`."""

    rows: int = 1
    tokens: int = 1
    counts: tuple[int, ...] = ()
    me: int = -1
    split: Callable[[Sequence[int]], list[int]] | None = None
    plain_rows: int = 0  # 0: the step as it is (no draft before this one)
    plain_counts: tuple[int, ...] = ()

    def cost(self, costs: Sequence[float], k: int) -> float:
        """C(k), in one-row steps: costs[r] is one pass of r rows (costs[0] = costs[1] = 1);
        it must reach rows + k."""
        return self.cost_with(costs, {self.me: k})

    def cost_with(self, costs: Sequence[float], drafts: dict[int, int]) -> float:
        """The step's cost with `drafts` (tokens drafted, by slot id) added to it."""
        if self.split is None or not self.counts:
            return costs[self.rows + sum(drafts.values())]
        counts = list(self.counts)
        for seq, k in drafts.items():
            counts[seq] += k
        return sum(costs[r] for r in self.split(counts))

    def widest(self, costs: Sequence[float], most: int) -> int:
        """The longest draft, up to `most`, that keeps the step within MAX_SLOWDOWN of its
        plain cost; `most` when no other stream decodes in it."""
        if self.tokens <= 1 or most <= 0:
            return most
        if self.split is None or not self.plain_counts:
            plain = costs[self.plain_rows or self.rows]
        else:
            plain = sum(costs[r] for r in self.split(self.plain_counts))
        k = most
        while k > 0 and self.cost(costs, k) > MAX_SLOWDOWN * plain:
            k -= 1
        return k


# How much dearer the drafts of a step shared by several decoding streams may make it,
# for the streams that draft nothing in it. Measured on Gemma-3 at 2 threads (4 server
# streams, same prompt, temperature 0): where two streams' answers copied and two did
# not, unbounded drafts (one pass of 4 rows then one of 14: 6.5 one-row steps against
# 1.8) took the aggregate to 0.83-0.91x lookup off, since the streams that never drafted
# waited through every wide step and finished last.
MAX_SLOWDOWN = 2.0


ALONE = StepShare()


@dataclass(frozen=True)
class Offer:
    """What a proposer would draft, before it is priced: a step that several decoding
    streams share is priced as a whole (shared_step.py), since on llama.cpp one stream's
    draft is cheap only beside its neighbours' drafts of the same length."""

    tokens: list[int]
    expected: list[float]  # expected[k]: the tokens a step yields with the first k drafted (expected[0] = 1)
    min_gain: float  # the least expected gain the proposer drafts for
    costs: Callable[[int], list[float]]  # the model's row prices up to a number of rows


class Proposer(ABC):
    @abstractmethod
    def draft(self, history: list[int], room: int, share: StepShare = ALONE) -> list[int]:
        """At most `room` tokens to verify after the pending one ([]: a plain step).
        `history` ends with the pending token; `share`: the step the draft would join."""

    @abstractmethod
    def record(self, judged: int, accepted: int) -> None:
        """The verdict on the last draft: of its tokens, `judged` were decided (fewer than
        drafted when verification stopped early) and the first `accepted` were kept."""

    def release(self) -> None:
        """The generation ended or can no longer draft: give back what this proposer
        holds beyond Python objects. It may be called more than once, and `record` may
        still follow (the verdict on the step that ended the generation). Prompt lookup
        holds nothing of the kind."""


class Offering(Proposer):
    """A proposer whose drafts cost it nothing to make (prompt lookup): in a step several
    decoding streams share it offers its draft unpriced, and the step's drafts are chosen
    together (shared_step.py). A draft model prices its own decode steps, so it drafts
    through `draft` alone."""

    @abstractmethod
    def offer(self, history: list[int], room: int) -> Offer | None:
        """What it would draft, up to `room` tokens, unpriced (None: nothing to draft);
        `take` then says how many of them the step verifies."""

    @abstractmethod
    def take(self, k: int) -> list[int]:
        """The first k tokens of the last offer, for this step (0: a plain step)."""


class FirstOf(Proposer):
    """Several proposers in order of preference: a step takes the first one's draft that
    is not empty (prompt lookup's, when the context offers a match that pays; else the
    draft model's). The one that drafted hears the verdict; the others hear that they
    drafted nothing, as on a plain step."""

    def __init__(self, *proposers: Proposer) -> None:
        self.proposers = proposers
        self._drafted: Proposer | None = None

    def draft(self, history: list[int], room: int, share: StepShare = ALONE) -> list[int]:
        self._drafted = None
        for p in self.proposers:
            tokens = p.draft(history, room, share)
            if tokens:
                self._drafted = p
                return tokens
        return []

    def record(self, judged: int, accepted: int) -> None:
        for p in self.proposers:
            if p is self._drafted:
                p.record(judged, accepted)
            else:
                p.record(0, 0)
        self._drafted = None

    def release(self) -> None:
        for p in self.proposers:
            p.release()

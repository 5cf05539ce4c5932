"""Where each sequence lives, for backends that batch only neighbouring slots.

llama.cpp, with a KV stream per sequence, puts into one forward pass only sequences
whose ids rise by one (0, 1, 2 but not 0, 2). Every gap among the slots of a step costs
one more pass over the weights: on the 2-core test machine a Gemma-3-270M step of 4
streams took 58-60 ms with a gap or out of order, 35-38 ms in one run. So the engine places a new request in a slot that keeps the busy slots in
one run, copying a cached prefix there when that saves reading enough of the prompt,
and it moves a running generation into a gap when others finish around it.

A copy of a sequence's KV costs about one decode step at a 4k context (measured there:
SmolLM2 10 ms, Gemma-3-270M 7 ms), so it pays for itself after a handful of tokens.
"""

from __future__ import annotations

from typing import Collection, Mapping

COPY_WORTH = 16  # prompt tokens a prefix copy must save (reading 16 tokens costs more than a copy)
MOVE_WORTH = 8  # tokens a generation must still be allowed to make before moving it pays


def runs(seqs: Collection[int]) -> int:
    """How many runs of consecutive ids `seqs` forms: the forward passes one step costs."""
    s = sorted(set(seqs))
    return sum(1 for i, x in enumerate(s) if i == 0 or s[i - 1] != x - 1)


def place(free: Collection[int], busy: Collection[int], shared: Mapping[int, int]) -> tuple[int, int | None]:
    """The free slot for a new request, and the slot whose cached prefix should be copied
    into it first (None: keep its own). `shared[s]` is how many prompt tokens free slot s
    already holds. Fewest runs first, then the longest own prefix, then the lowest id."""
    busy = set(busy)
    home = min(free, key=lambda s: (runs(busy | {s}), -shared[s], s))
    best = min(free, key=lambda s: (-shared[s], s))
    if shared[best] - shared[home] >= COPY_WORTH:
        return home, best
    return home, None


def move(left: Mapping[int, int], free: Collection[int]) -> tuple[int, int] | None:
    """One move (from, to) of a busy slot into a free one that lowers the runs of the busy
    slots, or None. `left[s]` is how many tokens the generation in slot s may still make;
    one with fewer than MOVE_WORTH stays put, since it ends before the move pays off.
    Among the best moves, the highest slot goes to the lowest free one, which packs the
    busy slots toward 0 where new requests land."""
    busy = set(left)
    now = runs(busy)
    if now <= 1:
        return None
    best = None
    for src in sorted(busy, reverse=True):
        if left[src] < MOVE_WORTH:
            continue
        for dst in sorted(free):
            after = runs(busy - {src} | {dst})
            if after < now and (best is None or after < best[0]):
                best = (after, src, dst)
    return None if best is None else (best[1], best[2])


def step_counts(live, budget: int, n_seq: int) -> list[int]:
    """The tokens each slot feeds a step before any draft (a decoding generation its
    pending token, a reading one its prompt chunk within the budget), by slot id: what
    the backend splits into passes when a draft is priced (speculation.proposer.StepShare)."""
    counts = [0] * n_seq
    for g in live:
        n = 1 if g.decoding else max(0, min(len(g.pending), budget))
        counts[g.seq] = n
        budget -= n
    return counts

"""Prompt-lookup speculative decoding: drafts from the context itself, exact verification.

`propose` finds the most recent earlier occurrence of the last n tokens and proposes
what followed it. Example, history = [5, 6, 7, 9, 5, 6], min_n=1, max_n=3, k=3: the
last 3 tokens, [9, 5, 6], do not occur earlier; the last 2, [5, 6], occur at 0..1,
followed by [7, 9, 5, 6] -> propose [7, 9, 5]. Never [] (a match exists) and never a
proposal taken from the suffix matching itself.

Verification (in the engine) scores the pending token plus the k drafts in one backend
step, then samples each row exactly as without speculation (same chain, same RNG
draw) and keeps a draft while it equals the sampled token. A draft x is therefore kept
with probability p(x), and on rejection the emitted token y != x has law
p(y) / (1 - p(x)): p with x removed, renormalised. The output is not only distributed
as without speculation, it is the same token sequence for the same seed, because every
emitted position consumes the RNG exactly as a plain step does (at temperature 0:
the same argmax).

`DraftController` adapts the draft length to the measured acceptance and to the
measured cost of a wider step (on a CPU a k-row step with all logits costs much more
than on a GPU, and most on a 262k vocabulary, where the output layer dominates), and
switches speculation off when it does not pay, probing again later. Its timing only
changes how many tokens a step verifies, never which tokens come out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(history, min_n: int = 1, max_n: int = 3, k: int = 8) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of history's last n tokens."""
    arr = np.asarray(history, dtype=np.int64)
    size = arr.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        if n <= 0:
            break
        # windows starting at 0 .. size-n-1: every earlier n-gram that has a follower
        windows = sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


@dataclass
class LookupConfig:
    enabled: bool = True
    min_n: int = 1
    max_n: int = 3
    max_draft: int = 8
    # Prior cost of one more verified row, in single-token steps, until measured: on
    # this project's 2-core CPU it measured 0.6 (SmolLM2) to 1.4 (Gemma-3, 262k vocab);
    # on a GPU or Apple Silicon it is far less.
    cost_per_draft: float = 0.5
    cooldown_steps: int = 16  # steps without drafting after speculation stopped paying
    measure_cost: bool = True  # False keeps cost_per_draft (deterministic draft lengths)


class DraftController:
    """Picks the draft length from the acceptance rate and the measured row cost."""

    PROBE_RATE = 0.8

    def __init__(self, cfg: LookupConfig) -> None:
        self.cfg = cfg
        self.rate = self.PROBE_RATE  # optimistic start: the first drafts measure the real rate
        self.row_cost = cfg.cost_per_draft  # replaced by measurement as steps come in
        self._plain_ms: float | None = None
        self.cooldown = 0
        self.drafted = 0
        self.accepted = 0
        self.steps = 0
        self.emitted = 0

    def draft_length(self) -> int:
        if not self.cfg.enabled:
            return 0
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        best_k, best_gain = 0, 1.0
        for k in range(1, self.cfg.max_draft + 1):
            # expected tokens per step / relative step cost
            expected = sum(self.rate**i for i in range(k + 1))
            gain = expected / (1.0 + self.row_cost * k)
            if gain > best_gain:
                best_k, best_gain = k, gain
        if best_k == 0:
            self.cooldown = self.cfg.cooldown_steps
            self.rate = self.PROBE_RATE  # probe with a fresh estimate after the cooldown
        return best_k

    def observe_step(self, drafted: int, ms: float) -> None:
        """Time of a decode step that verified `drafted` extra rows (0: a plain step)."""
        if not self.cfg.measure_cost:
            return
        if drafted == 0:
            self._plain_ms = ms if self._plain_ms is None else 0.8 * self._plain_ms + 0.2 * ms
        elif self._plain_ms:
            extra = max(0.0, ms - self._plain_ms) / drafted / self._plain_ms
            self.row_cost = 0.7 * self.row_cost + 0.3 * extra

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.emitted += emitted
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            # Tokens after the first rejection were never judged: the trials are the
            # accepted ones plus that one rejection.
            trials = accepted + (1 if accepted < drafted else 0)
            self.rate = 0.7 * self.rate + 0.3 * (accepted / trials)

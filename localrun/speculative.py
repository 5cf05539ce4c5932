"""Prompt-lookup speculative decoding: drafts from the context itself, exact verification.

`propose` finds the most recent earlier occurrence of the last n tokens and proposes
what followed it. Example, history = [5, 6, 7, 9, 5, 6], min_n=1, max_n=3, k=3: the
last 3 tokens, [9, 5, 6], do not occur earlier; the last 2, [5, 6], occur at 0..1,
followed by [7, 9, 5, 6] -> propose [7, 9, 5]. Never [] (a match exists) and never a
proposal taken from the suffix matching itself.

Verification (in the engine) scores the pending token plus the k drafts in one backend
step. Greedy: a draft is kept while it equals the argmax. Sampling: a draft x, which was
chosen deterministically, is kept with probability p(x) under the chain's final
distribution; on rejection the token is drawn from p with x removed, renormalised.
Then P(y) = p(x)[y = x] + (1 - p(x)) p(y) / (1 - p(x)) [y != x] = p(y): the output
distribution is exactly the non-speculative one.

`DraftController` adapts the draft length to the measured acceptance and switches
speculation off when it does not pay, probing again later. It uses acceptance counts
only, never wall-clock time, so a seeded run reproduces exactly.
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


def accept_or_resample(ids: np.ndarray, probs: np.ndarray, draft: int, rng: np.random.Generator) -> tuple[bool, int]:
    """Keep `draft` with probability p(draft); else draw from p without it.

    Returns (kept, token). `ids`/`probs` are the final distribution of the chain.
    """
    where = np.flatnonzero(ids == draft)
    p_x = float(probs[where[0]]) if where.size else 0.0
    if p_x > 0.0 and rng.random() < p_x:
        return True, draft
    if where.size:
        probs = probs.copy()
        probs[where[0]] = 0.0
        total = probs.sum()
        if total <= 0.0:  # p(x) was 1 within rounding: nothing else to draw
            return True, draft
        probs /= total
    return False, int(ids[int(rng.choice(ids.size, p=probs))])


@dataclass
class LookupConfig:
    enabled: bool = True
    min_n: int = 1
    max_n: int = 3
    max_draft: int = 8
    # Cost of scoring k extra tokens, in single-token steps: ~1 + 0.17k on a CPU
    # (SmolLM2/Gemma-3-270M, llama.cpp); far less on a GPU or Apple Silicon.
    cost_per_draft: float = 0.17
    cooldown_steps: int = 16  # steps without drafting after speculation stopped paying


class DraftController:
    """Picks the draft length from the acceptance rate; pure bookkeeping, no timing."""

    def __init__(self, cfg: LookupConfig) -> None:
        self.cfg = cfg
        self.rate = 0.5  # optimistic start: the first drafts measure the real rate
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
            gain = expected / (1.0 + self.cfg.cost_per_draft * k)
            if gain > best_gain:
                best_k, best_gain = k, gain
        if best_k == 0:
            self.cooldown = self.cfg.cooldown_steps
            self.rate = 0.5  # probe with a fresh estimate after the cooldown
        return best_k

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

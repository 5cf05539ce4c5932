"""DRY ("don't repeat yourself"): the penalties for the tokens that would extend a
repeat of the context's end. The sequence breakers that cap a repeat are resolved to
token ids in `breakers` (TokenText)."""

from __future__ import annotations

import math

import numpy as np

from .breakers import DryBreakers



def dry_penalties(
    window: np.ndarray, multiplier: float, base: float, allowed_length: int, breakers: DryBreakers
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, penalties) for the tokens that would extend a repeat of the context's
    end, following llama.cpp's DRY.

    For each earlier position q, L(q) = the length of the longest common suffix of
    window[:q+1] and the whole window, capped at `rep_limit` (the tokens since the last
    sequence breaker). The token after q, window[q+1], would make that repeat L+1 long;
    if L >= allowed_length it is penalised multiplier * base^(L - allowed_length), using
    its largest L. Single-token breakers are never penalised."""
    n = window.shape[0]
    allowed = allowed_length
    empty = (np.empty(0, dtype=np.int64), np.empty(0))
    if n <= allowed:
        return empty
    rep_limit = _dry_rep_limit(window, breakers)
    if rep_limit < allowed:
        return empty
    # Lengths past allowed + max_exponent all get the clamped penalty: no need to
    # measure them, which bounds the work on long degenerate repeats.
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    cap = min(rep_limit, allowed + max_exp) if max_exp > 0 else rep_limit
    # Extend all candidate matches backwards together, one token per numpy step.
    q = np.flatnonzero(window[:-1] == window[-1]) if cap > 0 else np.empty(0, dtype=np.int64)
    ends, lens = [], []
    s = 1
    while q.size and s < cap:
        prev = q - s
        ok = prev >= 0
        ok[ok] = window[prev[ok]] == window[n - 1 - s]
        ends.append(q[~ok])
        lens.append(np.full(int((~ok).sum()), s))
        q = q[ok]
        s += 1
    ends.append(q)
    lens.append(np.full(q.size, s))
    ends_a, lens_a = np.concatenate(ends), np.concatenate(lens)
    if allowed == 0:  # every position counts, matched or not
        ends_a = np.concatenate([np.arange(n - 1), ends_a])
        lens_a = np.concatenate([np.zeros(n - 1, dtype=np.int64), lens_a])
    hit = lens_a >= allowed
    if not hit.any():
        return empty
    toks, inv = np.unique(window[ends_a[hit] + 1], return_inverse=True)
    best = np.zeros(toks.size, dtype=np.int64)
    np.maximum.at(best, inv, lens_a[hit])
    keep = ~breakers.is_single(toks)
    toks, best = toks[keep], best[keep]
    exp = best - allowed
    if max_exp > 0:
        exp = np.minimum(exp, max_exp)
    return toks, multiplier * np.power(float(base), exp.astype(np.float64))


def _dry_rep_limit(window: np.ndarray, breakers: DryBreakers) -> int:
    """Tokens after the most recent complete breaker (the whole window if none)."""
    n = window.shape[0]
    if breakers.empty:
        return n
    for pos in np.flatnonzero(breakers.is_head(window))[::-1]:
        dist = n - 1 - int(pos)
        token = window[pos : pos + 1]
        longest = 0 if breakers.is_single(token)[0] else -1
        for tail in breakers.tails_of(int(token[0])):
            if longest < len(tail) <= dist and tuple(window[pos + 1 : pos + 1 + len(tail)].tolist()) == tail:
                longest = len(tail)
        if longest >= 0:
            return dist - longest
    return n

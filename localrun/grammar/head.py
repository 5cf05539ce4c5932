"""A grammar over a chain that needs only its best few ids (greedy, or top-k first)
without its full mask, which costs up to ~15 ms on a 262k vocabulary (free text inside a
JSON string): the ranked head of the row is checked one id at a time (~1 us each).

Exact: the chain draws only from the `need` best allowed ids, and those are found
whether or not the mask is built. The full mask runs when the head holds too few allowed
ids, or when per-token probabilities over every allowed token are asked for (n_probs).
"""

from __future__ import annotations

import numpy as np


def constrained_row(matcher, sampler, row: np.ndarray, history: list[int]) -> np.ndarray:
    """The row the sampler may draw from under `matcher`'s grammar: as is when the head's
    best ids are all allowed, else with only the needed allowed ids kept, else masked."""
    head = None if sampler.params.n_probs else sampler.grammar_head(row, history)
    if head is None:
        return matcher.apply(row)
    ranked, need = head
    keep = []
    for t in ranked.tolist():
        if matcher.allows(t):
            keep.append(t)
            if len(keep) == need:
                break
    if len(keep) < need:
        return matcher.apply(row)
    if keep == ranked[:need].tolist():
        return row
    out = np.full(row.shape[0], -np.inf, np.float32)
    out[keep] = row[keep]
    return out

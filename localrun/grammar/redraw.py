"""A grammar over a chain that keeps every id (top-k 0, no truncation: Sampler.
reweighs_only) without its full mask, which costs up to ~15 ms over a large vocabulary:
draw from the whole row and keep the draw if the grammar allows it (~1 us to ask), else
take that id out and draw again; after REDRAWS refusals, the mask.

Exact: each refusal conditions the chain's law on the ids left, which hold every allowed
one, so the token's law is the masked row's. A stretch the model does not know (a call
syntax new to it) refuses draw after draw: after one, the next steps mask at once, 1,
then 2, 4 ... up to MASK_BACKOFF_MOST in a row, until a redraw is allowed again.

`g` is a localrun.generation.Generation with a matcher.
"""

from __future__ import annotations

import numpy as np

from .json_budget import CLOSING_RESERVE

REDRAWS = 4
MASK_BACKOFF_MOST = 32


def redraws(g) -> bool:
    """Whether g's grammar may hold its draw by redrawing: a chain that keeps every id,
    no per-token probabilities asked, no JSON budget narrowing (json_budget)."""
    closing = g.closes_json and g.tokens_left <= CLOSING_RESERVE
    return not g.sampler.params.n_probs and not closing and g.sampler.reweighs_only()


def draw_allowed(g, raw_row) -> int:
    """A token from g's chain over the ids g's grammar allows; the backend's `raw_row`
    is never written."""
    m, row = g.matcher, raw_row
    if g.masked_steps_left:  # the grammar and the model disagreed lately: mask at once
        g.masked_steps_left -= 1
        return g.sampler.sample(m.apply(row), g.history)
    for _ in range(REDRAWS):
        token = g.sampler.sample(row, g.history)
        if m.allows(token):
            g.mask_backoff = 1
            return token
        if row is raw_row:
            row = np.array(raw_row, dtype=np.float32)
        row[token] = -np.inf
    g.masked_steps_left, g.mask_backoff = g.mask_backoff, min(2 * g.mask_backoff, MASK_BACKOFF_MOST)
    return g.sampler.sample(m.apply(row), g.history)

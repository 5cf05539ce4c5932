"""The drafts of a step several decoding streams share, chosen together.

Priced one stream at a time, a draft in a shared llama.cpp step never pays: the backend
splits a step into passes that take the same number of tokens from each of a run of
neighbouring sequences, so one stream's k drafted tokens ride in a pass of their own
(c(2) + c(k) for two streams, where c(r) is one pass of r rows), while two streams that
both draft k share one pass (c(2 + 2k)). Measured on Gemma-3 at 2 threads (one-row
steps): two streams' tokens 1.39, one of them drafting 3 more 2.95, both drafting 3
2.81. Each stream, asked in turn, saw only the first shape and drafted nothing, so two
server clients that were both copying decoded at lookup off's speed.

So each stream offers its draft unpriced (Proposer.offer: the tokens and the expected
yield of each length), and the step takes the lengths that maximise the whole step's
tokens per unit of cost: a common cap L (each stream drafts min(L, its offer)), the
shortest within NEAR_BEST of the best, then any stream whose draft the step does better
without is dropped. What it may cost the streams that gain least stays bounded (see
`fair`)."""

from __future__ import annotations

from .lookup import NEAR_BEST
from .proposer import MAX_SLOWDOWN, Offer, StepShare


def fair(share: StepShare, lengths: dict[int, int], offers: dict[int, Offer], cost: float, plain: float) -> bool:
    """Whether no decoding stream of the step gets its tokens at under 1/MAX_SLOWDOWN of
    the rate it had without drafts: a stream that drafts nothing gets one token from the
    dearer step (StepShare's rule), one that drafts its expected tokens. Measured where
    half of four streams copied: unbounded drafts took the aggregate to 0.83-0.91x lookup
    off, since the streams that never drafted waited through every wide step."""
    drafting = [offers[seq].expected[k] for seq, k in lengths.items() if k]
    worst = min(drafting) if len(drafting) == share.tokens else 1.0
    return cost <= MAX_SLOWDOWN * worst * plain


def choose(offers: dict[int, Offer], share: StepShare, room: int) -> dict[int, int]:
    """How many of its offered tokens each stream (by slot id) drafts in the step `share`
    describes (its plain rows and counts, and `tokens` decoding streams), the drafts
    taking at most `room` rows together."""
    if not offers or room <= 0:
        return {seq: 0 for seq in offers}
    longest = max(len(o.tokens) for o in offers.values())
    costs = next(iter(offers.values())).costs(share.rows + min(room, longest * len(offers)))
    plain = share.cost_with(costs, {})
    rate = share.tokens / plain
    min_gain = max(o.min_gain for o in offers.values())

    def gain(lengths: dict[int, int]) -> float:
        if sum(lengths.values()) > room:
            return 0.0
        cost = share.cost_with(costs, lengths)
        if not fair(share, lengths, offers, cost, plain):
            return 0.0
        tokens = share.tokens + sum(offers[seq].expected[k] - 1 for seq, k in lengths.items())
        return tokens / cost / rate

    capped = [{seq: min(cap, len(o.tokens)) for seq, o in offers.items()} for cap in range(longest + 1)]
    gains = [1.0] + [gain(lengths) for lengths in capped[1:]]
    best = max(range(longest + 1), key=gains.__getitem__)
    if gains[best] < min_gain:
        return capped[0]
    enough = max(NEAR_BEST * gains[best], min_gain)
    cap = next(cap for cap in range(1, best + 1) if gains[cap] >= enough)
    lengths, best_gain = capped[cap], gains[cap]
    for seq in offers:  # a stream whose draft the step is better without plans a plain step
        if lengths[seq]:
            without = gain({**lengths, seq: 0})
            if without > best_gain:
                lengths, best_gain = {**lengths, seq: 0}, without
    return lengths

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
`fair`).

**Filler.** A stream with nothing to offer between copying ones splits their pass just
as a lone draft does: slots 0, 2 and 3 drafting 3 beside slot 1's one token make three
passes (4, 3 and 6 rows). Given as many rows of `filler` (a guess, verified like any
draft, so it changes no token), it lets them share one. Measured on Gemma-3 at 2
threads (each shape timed in turn after a 200-token prompt in every slot, medians of
25, in one-row steps), counts 4,1,4,4 cost 5.57-5.66 and 4,4,4,4 3.21-3.53, with flash
attention on and off; filler rows without logits were no cheaper (3.84-3.87), so they
are verified rows. Traced at 8 server clients with flash attention off (where batch
drift had one stream's answer leave the copy), three slots at a 99% acceptance drafted
nothing for whole answers around the fourth. Each variant, with filler and without, is
priced by the same rule; on a backend that runs each sequence as its own pass (MLX)
filler never pays.
"""

from __future__ import annotations

from .lookup import NEAR_BEST
from .proposer import MAX_SLOWDOWN, Offer, StepShare

FILLER_LOOKBACK = 256  # how far back filler looks for the stream's last token


def fair(share: StepShare, lengths: dict[int, int], offers: dict[int, Offer], cost: float, plain: float) -> bool:
    """Whether no decoding stream of the step gets its tokens at under 1/MAX_SLOWDOWN of
    the rate it had without drafts: a stream that drafts nothing (or carries filler) gets
    one token from the dearer step (StepShare's rule), one that drafts its expected
    tokens. Measured where half of four streams copied: unbounded drafts took the
    aggregate to 0.83-0.91x lookup off, since the streams that never drafted waited
    through every wide step."""
    drafting = [offers[seq].expected[k] for seq, k in lengths.items() if k and seq in offers]
    worst = min(drafting) if len(drafting) == share.tokens else 1.0
    return cost <= MAX_SLOWDOWN * worst * plain


def choose(offers: dict[int, Offer], share: StepShare, room: int,
           fillable: dict[int, int] | None = None) -> dict[int, int]:
    """How many of its offered tokens each stream (by slot id) drafts in the step `share`
    describes (its plain rows and counts, and `tokens` decoding streams), the drafts
    taking at most `room` rows together; and, for the decoding streams in `fillable`
    (slot id -> most rows) that offered nothing, how many rows of filler each carries."""
    fillable = {seq: most for seq, most in (fillable or {}).items() if seq not in offers and most > 0}
    if not offers or room <= 0:
        return {seq: 0 for seq in offers}
    longest = max(len(o.tokens) for o in offers.values())
    costs = next(iter(offers.values())).costs(share.rows + min(room, longest * (len(offers) + len(fillable))))
    plain = share.cost_with(costs, {})
    rate = share.tokens / plain
    min_gain = max(o.min_gain for o in offers.values())

    def gain(lengths: dict[int, int]) -> float:
        if sum(lengths.values()) > room:
            return 0.0
        cost = share.cost_with(costs, lengths)
        if not fair(share, lengths, offers, cost, plain):
            return 0.0
        tokens = share.tokens + sum(offers[seq].expected[k] - 1 for seq, k in lengths.items() if seq in offers)
        return tokens / cost / rate

    def filled(lengths: dict[int, int]) -> dict[int, int]:
        widest = max(lengths.values())
        return {**lengths, **{seq: min(widest, most) for seq, most in fillable.items()}}

    # by cap, the lengths without filler and (where some stream could carry it) with
    candidates = [{seq: 0 for seq in offers}]
    for cap in range(1, longest + 1):
        lengths = {seq: min(cap, len(o.tokens)) for seq, o in offers.items()}
        candidates += [lengths, filled(lengths)] if fillable else [lengths]
    gains = [1.0] + [gain(lengths) for lengths in candidates[1:]]
    best = max(range(len(candidates)), key=gains.__getitem__)
    if gains[best] < min_gain:
        return candidates[0]
    enough = max(NEAR_BEST * gains[best], min_gain)
    pick = next(i for i in range(1, best + 1) if gains[i] >= enough)
    lengths, best_gain = candidates[pick], gains[pick]
    for seq in list(lengths):  # a stream whose rows the step is better without plans a plain step
        if lengths[seq]:
            without = gain({**lengths, seq: 0})
            if without > best_gain:
                lengths, best_gain = {**lengths, seq: 0}, without
    return lengths


def filler(history: list[int], k: int) -> list[int]:
    """k tokens for a stream with nothing to copy to carry (see the module's "Filler"):
    what followed the last earlier occurrence of its last token, within FILLER_LOOKBACK
    tokens, then that token again. Any guess is verified; a good one is a token won."""
    last = history[-1]
    for i in range(len(history) - 2, max(-1, len(history) - 2 - FILLER_LOOKBACK), -1):
        if history[i] == last:
            tokens = history[i + 1 : i + 1 + k]
            return tokens + [last] * (k - len(tokens))
    return [last] * k

"""A draft model: a smaller model of the same vocabulary that proposes the target's next
tokens, behind the same Proposer seam as prompt lookup.

`DraftModel` holds the second backend (its own KV slots, one per target slot) and what
its drafts have earned: how often a draft token of a given confidence was kept
(`Calibration`), and what one of its decode steps costs next to one of the target's.
`DraftModel.proposer()` gives a generation a `DraftModelProposer` on a free draft slot.

**Exactness.** The draft model drafts greedily: its token is the argmax of its own row,
a function of the history. Such a proposal is a point mass, and the engine's verification
(keep a drafted token while it equals the token the target's own sampling draws from its
row) is then exact under any sampler chain and grammar: the output is distributed as
without a draft (see proposer.py). The same seed gives the same tokens only where a wide
step's rows equal one-row steps' bit for bit, which is prompt lookup's numerics caveat:
Qwen2.5-Coder's Q4_K rows differ by 0.2-0.35 logits between the two shapes on this CPU
(SmolLM2's with flash attention on do not). At temperature 0 the guard is prompt
lookup's too (`LookupConfig.exact_greedy`).

**Pricing.** Each draft token costs a decode step of the draft model *before* the target
step, and every stream of that step waits for it; the target step also grows a row per
drafted token. With d streams decoding, a step of r rows costing c(r) target one-row
steps, a draft step costing delta of those, and a_i the estimated odds that draft token i
is kept (from its confidence, calibrated by what was kept), k drafted tokens pay when

    (d + a_1 + a_1 a_2 + ... + a_1...a_k) / (c(r + k) + k delta)  >  d / c(r).

The proposer drafts one token at a time and goes on while one more token, at the odds
of the last, is expected to raise that ratio; it then offers the prefix with the best
ratio, or nothing when none beats a plain step by `min_gain`. Before the first token of
a step it judges by the odds its first tokens have lately had. A step that declines
lets those odds drift back toward their prior, so that a draft model judged too dear on a
bad stretch is tried again.

**KV.** A draft slot's KV follows the history lazily: before drafting, it is cut back to
what it shares with the history and the rest is read (the prompt, the first time; the
tokens a prompt-lookup draft or a plain step added since). That reading is priced too,
spread over the steps the answer has left: a draft after 200 unread tokens of an open
chat, unpriced, ran that answer at 0.7x. A rejected draft's tokens are cut the next
time. An MLX rotating window that cannot be cut is read afresh.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from localrun.backends.base import BatchEntry, common_prefix

from ..errors import CacheNotTrimmableError, LocalrunError
from .proposer import ALONE, Proposer, StepShare
from .step_cost import StepCost

# Two vocabularies pair when they agree on every token both have; a few trailing ids may
# be padding (a model converted with its vocabulary rounded up), never more than this.
VOCAB_PADDING = 128
DRAFT_MAX = 16  # most tokens a step drafts, by default (llama-server's --draft-max)
RETIME_AFTER = 512  # declined steps between two timings of the draft step
SLOW_ROUND_S = 1.0  # a load-time measuring round this slow is done once more, not twice (DraftModel.measure)
MIN_GAIN = 1.05  # draft only when a step is expected to yield this much more per unit of time


class DraftPairError(LocalrunError):
    """A draft model that cannot draft for the target (a different vocabulary)."""

    exit_code = 2


def check_pair(target, draft, target_name: str = "the model", draft_name: str = "the draft model") -> None:
    """Raise DraftPairError, one line saying why, unless `draft` (a backend) writes every
    token as `target` does and marks the same special tokens: then its drafts are the
    target's tokens. Reads both vocabularies (~0.2 s each for 152k tokens)."""
    ti, di = target.info, draft.info

    def refuse(why: str) -> DraftPairError:
        return DraftPairError(f"{draft_name} cannot draft for {target_name}: {why};"
                              " pick a draft model of the same family and tokenizer")

    if abs(ti.n_vocab - di.n_vocab) > VOCAB_PADDING:
        raise refuse(f"its vocabulary has {di.n_vocab} tokens, the model's {ti.n_vocab}")
    for what in ("bos_id", "eos_id", "eot_id", "add_bos"):
        if getattr(ti, what) != getattr(di, what):
            raise refuse(f"its {what} is {getattr(di, what)!r}, the model's {getattr(ti, what)!r}")
    if ti.stop_ids != di.stop_ids:
        raise refuse(f"it stops on tokens {sorted(di.stop_ids)}, the model on {sorted(ti.stop_ids)}")
    for t in range(min(ti.n_vocab, di.n_vocab)):
        if target.token_bytes(t) != draft.token_bytes(t) or target.is_control(t) != draft.is_control(t):
            raise refuse(f"token {t} is {draft.token_bytes(t)!r} there, {target.token_bytes(t)!r} in the model")


class Calibration:
    """The odds a draft token is kept, by the draft model's own probability for it (its
    confidence, in BINS bands), learned from verdicts; separately for greedy and sampled
    targets (a sampled target keeps a token only as often as it draws it). A band starts
    at its own confidence (a draft model that agrees with its target) with PRIOR_WEIGHT
    verdicts' worth of weight; verdicts decay by DECAY so the odds follow the text."""

    BINS = 10
    PRIOR_WEIGHT = 4.0
    DECAY = 0.995
    FIRST_PRIOR = 0.6  # a step's first token, before any verdict: llama-server's pairs keep ~0.6-0.8
    FIRST_RECOVERY = 0.02  # a declined step moves the first-token odds this much back toward their prior

    def __init__(self) -> None:
        self._hits = np.zeros((2, self.BINS))
        self._trials = np.zeros((2, self.BINS))
        self._first = [self.FIRST_PRIOR, self.FIRST_PRIOR]  # a step's first token, greedy / sampled

    def odds(self, confidence: float, greedy: bool) -> float:
        b = min(int(confidence * self.BINS), self.BINS - 1)
        centre = (b + 0.5) / self.BINS
        g = 0 if greedy else 1
        return float((self._hits[g, b] + centre * self.PRIOR_WEIGHT) / (self._trials[g, b] + self.PRIOR_WEIGHT))

    def first_odds(self, greedy: bool) -> float:
        return self._first[0 if greedy else 1]

    def declined(self, greedy: bool) -> None:
        g = 0 if greedy else 1
        self._first[g] += self.FIRST_RECOVERY * (self.FIRST_PRIOR - self._first[g])

    def judged(self, confidences: Sequence[float], judged: int, accepted: int, greedy: bool) -> None:
        g = 0 if greedy else 1
        self._hits[g] *= self.DECAY
        self._trials[g] *= self.DECAY
        for i, q in enumerate(confidences[:judged]):
            b = min(int(q * self.BINS), self.BINS - 1)
            self._trials[g, b] += 1
            self._hits[g, b] += i < accepted
        if judged:
            self._first[g] += 0.1 * ((accepted > 0) - self._first[g])


class DraftModel:
    """A draft model loaded beside a target; one per target engine."""

    def __init__(self, backend, draft_max: int = DRAFT_MAX, name: str = "the draft model",
                 target_vocab: int | None = None) -> None:
        """`backend`: the draft model, loaded with the target's n_ctx and n_seq (a slot
        each). `draft_max`: most tokens one step drafts. `target_vocab`: the target's
        vocabulary size (check_pair allows a little padding on either side)."""
        if draft_max < 1:
            raise LocalrunError(f"--draft-max must be at least 1, got {draft_max}")
        self.backend = backend
        # the ids both vocabularies have: a draft of a padding id the target lacks would be
        # a decode the target refuses
        self.vocab = min(backend.info.n_vocab, target_vocab or backend.info.n_vocab)
        self.name = name
        self.draft_max = draft_max
        self.calibration = Calibration()
        self._free = list(range(backend.n_seq))
        self._step_ms: float | None = None  # a draft decode of one token, decayed mean
        self._declines = 0  # steps that did not draft (see declined)
        self._read_ms: float | None = None  # a token of a batch the draft model reads (catching up), least seen
        # before the first draft step is timed: its cost by parameter count (a step on a
        # CPU or GPU is mostly reading the weights), with a floor for the per-step overhead
        self._prior_delta: float | None = None

    def proposer(self, prompt: Sequence[int], step_cost: StepCost, greedy: bool,
                 target_params: int = 0) -> "DraftModelProposer | None":
        """A proposer on the free draft slot whose KV shares most with `prompt`; None when
        every slot is taken (the generation decodes without a draft model)."""
        if not self._free:
            return None
        if self._prior_delta is None:
            own = self.backend.info.n_params
            self._prior_delta = max(0.1, own / target_params) if own and target_params else 0.5
        best = max(self._free, key=lambda s: common_prefix(self.backend.kv_tokens(s), prompt))
        self._free.remove(best)
        return DraftModelProposer(self, best, step_cost, greedy)

    def give_back(self, seq: int) -> None:
        if seq not in self._free:
            self._free.append(seq)

    def step_delta(self, cost: StepCost) -> float:
        """A draft step's cost in the target's one-row steps (prior until both are timed)."""
        target_ms = cost.one_row_ms()
        if self._step_ms is None or target_ms is None:
            return self._prior_delta if self._prior_delta is not None else 0.5
        return self._step_ms / target_ms

    def read_delta(self, cost: StepCost) -> float:
        """A token the draft model reads in a batch, in the target's one-row steps."""
        target_ms = cost.one_row_ms()
        if self._read_ms is None or target_ms is None:
            return self.step_delta(cost) / 4  # a batch reads a token several times faster than a step
        return self._read_ms / target_ms

    def timed(self, ms: float) -> None:
        self._step_ms = ms if self._step_ms is None else 0.9 * self._step_ms + 0.1 * ms

    def declined(self, seq: int) -> None:
        """A step did not draft. Every RETIME_AFTER of them the draft step is timed again
        (one decode past the end of `seq`'s KV, cut back at once: ~0.1% of the steps'
        time): a price measured while the machine was busy must not keep drafting off
        for the rest of the session (a load spike at load read 34 ms for a 20 ms step)."""
        self._declines += 1
        if self._declines % RETIME_AFTER == 0:
            end = len(self.backend.kv_tokens(seq))
            if end < self.backend.n_ctx:
                try:
                    self.timed(self._time_one_step(seq, 0, end))
                except CacheNotTrimmableError:  # an MLX window: the next draft reads the history afresh
                    self.backend.kv_clear(seq)

    def _time_one_step(self, seq: int, token: int, pos: int) -> float:
        """ms of one draft decode of `token` at `pos` in `seq`, whose KV is cut back to pos."""
        self.backend.kv_trim(seq, pos)
        t0 = time.perf_counter()
        self.backend.decode([BatchEntry(seq, [token], pos, 1)])
        ms = (time.perf_counter() - t0) * 1000
        self.backend.kv_trim(seq, pos)
        return ms

    def measure(self, target, cost: StepCost, rounds: int = 2) -> None:
        """Time the pair once, when loaded: the target's steps of 1, 2, 4 and 8 rows (into
        `cost`, the target's StepCost) and the draft model's one-row step, after a round
        that is not timed (a fresh context's first decodes build its graphs: 2-3x a
        step). Without it the first answer would learn the prices by drafting, and on a
        CPU, where a target's 2-row step can cost 1.9 one-row steps (Qwen2.5-Coder-1.5B
        here), that first answer ran 0.7x its speed without a draft. ~1 s for 1.5B here.
        Slot 0 of both is used and left empty. Where the untimed round alone took over
        SLOW_ROUND_S (MLX on a CPU: ~4.5 s a round for SmolLM2 here), one timed round
        follows instead of `rounds`."""
        # any tokens: only the time counts; a context and widths that fit the smallest
        # n_ctx (16) and n_batch the options allow
        room = min(target.n_ctx, self.backend.n_ctx)
        n_batch = min(target.n_batch, self.backend.n_batch)
        widths = tuple(w for w in (1, 2, 4, 8) if w <= n_batch and w < room // 2)
        context = [t % self.vocab for t in range(1000, 1000 + min(32, n_batch, room - widths[-1]))]
        def one_round(timed: bool) -> None:
            self.backend.kv_clear(0)
            t0 = time.perf_counter()
            self.backend.decode([BatchEntry(0, context, 0, 0)])
            if timed:  # what catching the draft slot up costs a token (see DraftModelProposer.draft)
                ms = (time.perf_counter() - t0) * 1000 / len(context)
                self._read_ms = ms if self._read_ms is None else min(self._read_ms, ms)
            for w in widths:
                target.kv_trim(0, len(context))
                t0 = time.perf_counter()
                target.decode([BatchEntry(0, context[:w], len(context), w)])
                if timed:
                    cost.observe(w, (time.perf_counter() - t0) * 1000, drafting=True)
            ms = self._time_one_step(0, context[0], len(context))
            if timed:  # the least of the rounds: load only ever adds time
                self._step_ms = ms if self._step_ms is None else min(self._step_ms, ms)

        try:
            target.decode([BatchEntry(0, context, 0, 0)])
            started = time.perf_counter()
            one_round(timed=False)
            for _ in range(1 if time.perf_counter() - started > SLOW_ROUND_S else rounds):
                one_round(timed=True)
        finally:
            target.kv_clear(0)
            self.backend.kv_clear(0)

    def close(self) -> None:
        self.backend.close()


class DraftModelProposer(Proposer):
    """One generation's drafts from the draft model, on its own draft slot."""

    def __init__(self, model: DraftModel, seq: int, cost: StepCost, greedy: bool) -> None:
        self.model = model
        self.seq = seq
        self.cost = cost
        self.greedy = greedy
        self._flight: list[float] = []  # the confidences of the draft in flight
        self._synced = 0  # history tokens the draft slot is known to hold, in order
        self._released = False
        self.widths: list[int] = []  # the lengths offered, for benchmarks and tests

    def draft(self, history: list[int], room: int, share: StepShare = ALONE) -> list[int]:
        self._flight = []
        most = min(room, self.model.draft_max)
        if most <= 0 or self._released:
            return []
        cal, greedy = self.model.calibration, self.greedy
        delta = self.model.step_delta(self.cost)
        costs = self.cost.ratios(share.rows + most, 0.25)
        most = share.widest(costs, most)  # the others' bound (StepShare.widest)
        if most <= 0:
            return []
        others = share.tokens - 1
        plain = share.tokens / share.cost(costs, 0)
        catch_up = 0.0

        def rate(expected: float, k: int) -> float:  # tokens per one-row step of k drafted tokens
            return (others + expected) / (share.cost(costs, k) + k * delta + catch_up)

        first = 1 + cal.first_odds(greedy)
        if rate(first, 1) >= plain * MIN_GAIN:  # only then is reading the slot's backlog worth pricing
            # What the draft slot must read before it drafts (the prompt the first time, then
            # what lookup's drafts and declined steps added), spread over the steps left, which
            # `room` bounds: reading 200 tokens of answer unpriced cost an open chat 0.7x.
            catch_up = self._behind(history) * self.model.read_delta(self.cost) / max(1, room)
        if rate(first, 1) < plain * MIN_GAIN:
            cal.declined(greedy)
            self.model.declined(self.seq)
            return []
        self._sync(history[:-1])
        tokens: list[int] = []
        confidences: list[float] = []
        expected, reach, odds = 1.0, 1.0, cal.first_odds(greedy)
        best_k, best_rate = 0, plain * MIN_GAIN
        token, pos = history[-1], len(history) - 1
        while len(tokens) < most:
            # one more token, at the odds of the last: worth its draft step and its row?
            if rate(expected + reach * odds, len(tokens) + 1) <= max(best_rate, rate(expected, len(tokens))):
                break
            t0 = time.perf_counter()
            row = self.model.backend.decode([BatchEntry(self.seq, [token], pos, 1)])[0][0]
            token, q = _top(row)
            self.model.timed((time.perf_counter() - t0) * 1000)
            if token >= self.model.vocab:  # a padding id only the draft model has
                break
            pos += 1
            tokens.append(token)
            confidences.append(q)
            odds = cal.odds(q, greedy)
            reach *= odds
            expected += reach
            if rate(expected, len(tokens)) > best_rate:
                best_k, best_rate = len(tokens), rate(expected, len(tokens))
        self.widths.append(best_k)
        self._flight = confidences[:best_k]
        return tokens[:best_k]

    def _behind(self, history: list[int]) -> int:
        """How many tokens before the pending one the draft slot lacks."""
        have = self.model.backend.kv_tokens(self.seq)
        start = min(self._synced, len(have), len(history) - 1)  # known to match: history only grows
        self._synced = start + common_prefix(have[start:], history[start:-1])
        return len(history) - 1 - self._synced

    def _sync(self, fed: list[int]) -> None:
        """Make the draft slot's KV hold exactly `fed`: cut what it does not share (or
        clear a window that cannot be cut), read the rest."""
        backend = self.model.backend
        have = backend.kv_tokens(self.seq)
        keep = common_prefix(have, fed)
        if keep < len(have):
            try:
                backend.kv_trim(self.seq, keep)
            except CacheNotTrimmableError:
                backend.kv_clear(self.seq)
                keep = 0
        for start in range(keep, len(fed), backend.n_batch):
            chunk = fed[start : start + backend.n_batch]
            backend.decode([BatchEntry(self.seq, chunk, start, 0)])
        self._synced = len(fed)

    def record(self, judged: int, accepted: int) -> None:
        if self._flight:
            self.model.calibration.judged(self._flight, judged, accepted, self.greedy)
        self._flight = []

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.model.give_back(self.seq)


def _top(row) -> tuple[int, float]:
    """The draft row's argmax and its softmax probability."""
    row = np.asarray(row, dtype=np.float32)
    best = int(np.argmax(row))
    z = np.exp(row - row[best], dtype=np.float32)
    return best, float(1.0 / z.sum())


__all__ = ["Calibration", "DraftModel", "DraftModelProposer", "DraftPairError", "check_pair", "predicted_speedup"]


def predicted_speedup(odds: float, step_costs: Sequence[float], delta: float, most: int = DRAFT_MAX) -> tuple[int, float]:
    """What the pricing above predicts for one stream alone: the draft length k in
    0..most that maximises (1 + a + ... + a^k) / (c(1 + k) + k delta), and that ratio
    over a plain step's (1.0 at k = 0). `odds` a: each draft token's chance to be kept;
    `step_costs[r]`: a step of r rows over a one-row step (index 0 unused); `delta`: a
    draft step over a target one-row step. For benchmarks: fed this machine's measured
    costs, or a GPU's."""
    best_k, best = 0, 1.0
    expected, reach = 1.0, 1.0
    for k in range(1, min(most, len(step_costs) - 2) + 1):
        reach *= odds
        expected += reach
        ratio = expected / (step_costs[1 + k] + k * delta)
        if ratio > best:
            best_k, best = k, ratio
    return best_k, best

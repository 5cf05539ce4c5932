"""One model's speculative decoding, behind the engine's step: plan -> draft -> verify ->
observe.

The `Speculator` owns what a model's generations share: the step cost by width
(`StepCost`), the acceptance record its drafts earned lately (`Acceptance`), the batch
drift of its wide steps (`BatchDrift`, remembered between runs by drift_cache), and its
chat template's turn marks. The engine asks it to

- `attach` proposers to a generation (prompt lookup, per the request's `LookupConfig`,
  then the draft model, when one is loaded);
- `draft` for a decoding generation within the room its step has left;
- `verify` the rows a speculative step returned, token by token, with the engine's own
  token choice (grammar, sampler, stop strings) as `produce`;
- `observe` what a step took (a pass of r rows), which prices the next drafts.

**Verification** scores the pending token plus the k drafts in one backend step, then
samples each row exactly as without speculation (same chain, same RNG draw) and keeps a
draft while it equals the sampled token. A draft x is therefore kept with probability
p(x), and on rejection the emitted token y != x has law p(y) / (1 - p(x)): p with x
removed, renormalised. Every emitted position consumes the RNG exactly as a plain step
does. At temperature 0 a wide step's row may differ from a one-row step's in its last
bits; `LookupConfig.exact_greedy` bounds that (drift.py).

A generation here is a `localrun.generation.Generation` (the engine core's, one floor up,
so it is not imported): its history, KV position (`n_cached`), sampler and verdicts.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from localrun.backends.base import BatchEntry, DecodeInterrupted

from ..errors import CacheNotTrimmableError
from . import drift_cache
from .drift import margin_change
from .lookup import Acceptance, LookupConfig, LookupProposer
from .draft_model import DraftModel
from .proposer import ALONE, FirstOf, Offering, StepShare
from .shared_step import choose, filler
from .step_cost import StepCost

# produce(generation, row, now, lead) -> the event of the token chosen from `row`, or None
# when `lead` is given (greedy in a wide step) and the choice is too close to call
Produce = Callable[..., object]


class Speculator:
    def __init__(self, backend, spelling=None, stop_ids: frozenset[int] = frozenset()) -> None:
        """`spelling`: the vocabulary's TokenText (edits that mirror a bracket);
        `stop_ids`: the model's end-of-generation tokens (turn marks, never drafted)."""
        self.backend = backend
        self.spelling = spelling
        self.stop_ids = stop_ids
        self.step_cost = StepCost()  # what a wider speculative step costs on this model
        self.acceptance = Acceptance()  # what this model's drafts have done lately, per match length
        self._turn_marks: dict[int, bool] = {}  # token -> a control or end-of-generation token
        self.drift = drift_cache.recall(backend)  # how far a wide step's rows stray from one-row steps'
        self.draft_model: DraftModel | None = None  # a second model that drafts (the engine's --draft)

    # -- plan and draft -----------------------------------------------------------------

    def attach(self, g, cfg: LookupConfig) -> None:
        """Give g the proposers its request asks for: prompt lookup (unless turned off),
        then the draft model when one is loaded and has a free slot (draft_model.py)."""
        proposers = []
        if cfg.enabled:
            proposers.append(LookupProposer(cfg, self.step_cost, self.acceptance, answer_start=len(g.prompt),
                                            spelling=self.spelling, control=self.turn_marks(g.prompt)))
        if self.draft_model is not None:
            drafter = self.draft_model.proposer(g.prompt, self.step_cost, g.sampler.params.greedy,
                                                target_params=self.backend.info.n_params)
            if drafter is not None:
                proposers.append(drafter)
        if proposers:
            g.proposer = proposers[0] if len(proposers) == 1 else FirstOf(*proposers)
            g.exact_greedy = cfg.exact_greedy

    def turn_marks(self, tokens: Sequence[int]) -> frozenset[int]:
        """The control and end-of-generation tokens among `tokens` (a chat template's turn
        marks), which prompt lookup never drafts (see LookupProposer.draft)."""
        marks, distinct = self._turn_marks, set(tokens)
        # each token is asked once per model: a 6,000-token prompt took ~1 ms the first
        # time, 0.15 ms after (Qwen2.5; every distinct token asked each time: 1.3 ms)
        for t in distinct.difference(marks):
            marks[t] = t in self.stop_ids or self.backend.is_control(t)
        return frozenset(t for t in distinct if marks[t])

    def draft(self, g, room: int, n_ctx: int, share: StepShare = ALONE) -> list[int]:
        """g's draft for this step, within every limit it has: the step's room, its
        max_tokens, the context; priced in the step it joins (`share`)."""
        if not g.may_draft():
            return []
        k = min(room, g.tokens_left - 1, n_ctx - len(g.history) - 1)
        return g.proposer.draft(g.history, k, share) if k > 0 else []

    def draft_together(self, gens, room: int, n_ctx: int,
                       share: StepShare) -> tuple[dict[int, list[int]], set[int], list] | None:
        """The drafts of a step several decoding generations share, chosen together
        (shared_step.py): {slot id: draft} for each of `gens`, the slot ids whose draft is
        filler (rows that keep the step one pass, not a proposal: see shared_step), and
        the (generation, exception) of any whose proposer raised. None when one of them
        drafts through a proposer that does not offer (a draft model): each is then asked
        in turn (`draft`)."""
        if any(g.proposer is not None and not isinstance(g.proposer, Offering) for g in gens):
            return None
        drafts, failed, offers, offered, fillable = {g.seq: [] for g in gens}, [], {}, {}, {}
        for g in gens:
            if not g.may_draft():
                continue
            k = min(room, g.tokens_left - 1, n_ctx - len(g.history) - 1)
            if k <= 0:
                continue
            try:
                offer = g.proposer.offer(g.history, k)
            except Exception as exc:  # that generation ends alone (the engine's _fail)
                failed.append((g, exc))
                continue
            if offer is not None:
                offers[g.seq], offered[g.seq] = offer, g
            elif not self.recomputes(g):  # filler rows recomputed one by one would cost what they save
                fillable[g.seq], offered[g.seq] = k, g
        filled = set()
        for seq, k in choose(offers, share, room, fillable).items():
            g = offered[seq]
            if seq in offers:
                drafts[seq] = g.proposer.take(k)
            elif k:
                drafts[seq] = filler(g.history, k)
                filled.add(seq)
        return drafts, filled, failed

    # -- observe ------------------------------------------------------------------------

    def observe(self, entries: Sequence[BatchEntry], gens, ms: float) -> None:
        """A step of `entries` (those of `gens`) took `ms`, which prices the next drafts.
        A step that is one pass of decoding rows (every row wants its logits: no prompt
        chunk, whose rows cost less) is a pass of that many rows, one sequence's or several
        that the backend runs as one pass (a server's streams drafting one length): its
        time is that width's. A step split into passes says nothing clean about a width.
        Timing only one sequence's steps (the rule before) left the widths that only
        shared steps use at their optimistic prior for good (0.25 of a step a row: 20 rows
        at 5.75), where on SmolLM2 a pass of 16 rows costs 9.0 one-row steps as one
        sequence's and 9.5 as 4 sequences' (medians of 25): 4 server streams drafted 4-5
        tokens each where they kept 59%, and 8 clients decoded at 0.84x lookup off. (4
        sequences' one row each cost 3.18 against 2.61 for one sequence's 4: a server
        prices its plain steps, and the drafts beside them, by what its shared passes
        cost.) Steps shared only by streams that never draft are not timed: nobody prices
        from them, and a wide step's update costs ~0.1 ms."""
        if not all(g.decoding and e.n_logits == len(e.tokens) for e, g in zip(entries, gens)):
            return
        drafting = any(g.proposer is not None for g in gens)
        if len(entries) > 1 and not drafting:
            return
        if len(entries) > 1:
            counts = [0] * self.backend.n_seq
            for e in entries:
                counts[e.seq] += len(e.tokens)
            if len(self.backend.passes(counts)) != 1:
                return
        self.step_cost.observe(sum(len(e.tokens) for e in entries), ms, drafting)

    # -- verify -------------------------------------------------------------------------

    def recomputes(self, g) -> bool:
        """Whether verifying g's draft decodes its rows again, one at a time (exact greedy
        while the model's drift is still being measured)."""
        return g.exact_greedy and g.sampler.params.greedy and self.drift.calibrating

    def verify(self, g, draft: list[int], rows, now: float, produce: Produce, filled: bool = False) -> list:
        """The events of a speculative step's rows (the pending token's, then one per draft
        token): each row is sampled as a plain step would sample it, and a draft is kept
        while it is the token sampled; the KV of what was not kept is trimmed. Under
        `exact_greedy`, a row is trusted only where its greedy choice leads by more than
        the model's measured drift; the first row that does not is left to a one-row
        step. [] when no token came out (the very first row was left). `filled`: the
        draft is filler (shared_step.py), verified alike but no proposer's draft."""
        base = g.n_cached  # where the pending token sits
        exact = g.exact_greedy and g.sampler.params.greedy
        lead = None  # the lead a greedy token needs in a wide step's row
        if exact and self.drift.calibrating:
            rows = self._recompute_alone(g, draft, rows)  # exact: rows of one-row steps
            if rows is None:
                return []
        elif exact and self.drift.margin > 0:
            lead = self.drift.margin
        events: list = []
        kept, unsure = 0, False
        for i in range(len(draft) + 1):
            event = produce(g, rows[i], now, lead)
            if event is None:
                unsure = True
                break
            events.append(event)
            if g.done or i == len(draft) or event.tokens[-1:] != [draft[i]]:
                break
            kept += 1
        if unsure:  # the row of position base + i is recomputed alone next step
            g.redo_alone(base + len(events))
        else:
            g.fed(1 + kept)
        if g.n_cached < base + 1 + len(draft) and not g.done:
            try:
                self.backend.kv_trim(g.seq, g.n_cached)
            except CacheNotTrimmableError:  # an MLX rotating window: read the history again
                self.backend.kv_clear(g.seq)
                g.forgot()
        if events:
            # a row left to a one-row step costs what a rejection there would (the rows
            # after it are thrown away), so the proposer counts it as one
            if filled:  # not a draft: no verdict for the proposer, none in the timings
                g.stepped(0, 0, 0)
            else:
                g.stepped(len(draft), kept, min(kept + 1, len(draft)) if unsure else len(draft))
        return events

    @staticmethod
    def clear_greedy(g, row: np.ndarray, lead: float) -> int | None:
        """The greedy token of a wide step's row, or None when it leads the runner-up by
        no more than `lead` (a one-row step might choose otherwise)."""
        adjusted = g.sampler.adjusted(row, g.history)
        best = int(np.argmax(adjusted))
        before = adjusted[:best].max(initial=-np.inf)
        after = adjusted[best + 1 :].max(initial=-np.inf)
        return best if adjusted[best] - max(before, after) > lead else None

    def _recompute_alone(self, g, draft: list[int], wide_rows) -> list[np.ndarray] | None:
        """Decode the pending token and the draft again one row at a time (the rows a
        plain run would see), measuring on the way how far the wide step's rows strayed
        from them: how much the top-two margin of each row changed."""
        base = g.n_cached
        wide_rows = np.array(wide_rows)  # a backend's rows may live in a buffer the next decode reuses
        try:
            self.backend.kv_trim(g.seq, base)
            alone = []
            for j, token in enumerate([g.history[base]] + draft):
                row = np.array(self.backend.decode([BatchEntry(g.seq, [token], base + j, 1)])[0][0])
                self.drift.observe(margin_change(wide_rows[j], row))
                alone.append(row)
            if not self.drift.calibrating:
                drift_cache.remember(self.backend, self.drift)
            return alone
        except DecodeInterrupted:  # nothing is decided this step; the KV goes back to the pending token
            self.backend.kv_trim(g.seq, base)
            return None
        except CacheNotTrimmableError:  # no cut, no recomputing: the wide rows it is
            return wide_rows

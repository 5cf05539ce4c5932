"""Prompt lookup, the first proposer: drafts copied from the context itself.

**Drafting.** `NgramIndex` keeps, for one generation, where every pair of neighbouring
tokens occurred in its history (prompt + answer). To draft, it takes the most recent
earlier occurrences of the history's last two tokens, extends each match backwards
(how many tokens before them agree too), and proposes what followed the longest match.
Example, history = [5, 6, 7, 9, 5, 6]: the pair [5, 6] occurred at 0..1, the match is
2 tokens long, and [7, 9, 5, 6] followed it. Where the answer goes round a loop (a match
that ends a few tokens back and is at least twice that long), the draft goes on around
it past the history's end.

**Edits.** An answer that copies often changes what it copies the same way each time
(a renamed variable, a fixed word). Where a draft failed and the answer then agreed with
the source again a few tokens on, `LearnedEdits` keeps the difference as an edit: later
drafts copy with it made, and a match goes on behind it (a long match, not a fresh
2-token one). What it buys is measured in LookupConfig.learn_edits' comment.

**How much to draft.** A long match is evidence that the answer is copying a span (a
code edit, a quote), so `LookupProposer` keeps one acceptance estimate per band of
match length (one for copies of given text, one for phrases of the answer's own), and
`StepCost` (step_cost.py) follows what a step costs per number of rows, apart from the
machine's speed of the moment (on a CPU a wider step is sublinear:
weights are read once per step, so 17 rows cost ~7 single steps on Gemma-3, not 17).
The draft length is the one that maximises expected tokens per unit of step time; when
no length pays by a margin, the step is a plain one. These estimates change how many
tokens a step verifies, never which tokens come out.

**Evidence for free.** A plain step taken where a match existed still tests the lookup:
the controller keeps what it would have drafted (a shadow draft) and judges it against
the tokens the plain steps then produce, at no cost. So a band that stopped paying comes
back as soon as the answer starts copying again, and one whose drafts keep failing (an
open-ended chat after a session of code edits) stays quiet without paying for the
failed wide steps that would otherwise be its only way to learn.

Verification and its temperature-0 caveat are the speculator's (speculator.py, drift.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, takewhile
from typing import TYPE_CHECKING


from .edits import MAX_EDITS, LearnedEdits
from .proposer import ALONE, Offer, Offering, StepShare
from .step_cost import StepCost

if TYPE_CHECKING:
    from ..sampling import TokenText

# Match-length bands (upper bounds, inclusive) and the acceptance each starts from before
# any draft of this generation was judged: longer agreement with an earlier span makes
# copying likelier. The priors only open the door; measurements take over within a few
# drafts.
BANDS = (2, 4, 8, 16, 1 << 30)
PRIOR_RATE = (0.3, 0.5, 0.65, 0.85, 0.95)
# A phrase of the answer's own (_slot; see the note under LOOP_REPEATS) starts lower where
# its match is 9-16 tokens long: a copy of given text that long is nearly always followed
# on, a repeat of the answer's own sentence often is not.
OWN_PRIOR_RATE = (0.3, 0.5, 0.65, 0.7, 0.95)
_STARTS = PRIOR_RATE + OWN_PRIOR_RATE  # by _slot()
PRIOR_WEIGHT = 3.0  # the prior counts as this many judged tokens
DECAY = 0.9  # per draft judged in a band: older evidence fades
# The draft length taken is the shortest whose expected gain is within this fraction of
# the best length's. The acceptance estimate treats a copy's departures as independent
# token by token, but they come where the model rewrites what it copies, and after a run
# of kept drafts the estimate reaches 0.99+. Where a row costs ~0.45 one-row steps
# (SmolLM2 on this CPU) the expected gain barely rises past ~20 drafted tokens (a 48-token
# draft is expected to pay 1-2% more than a 24-token one) while a departure in it loses
# every row after it. Replayed on two measured tables (scripts/lookup/replay_lookup.py --load),
# the lowest grounded task over ngram-simple went from 0.94 and 0.96 to 1.00 and 1.00
# (SmolLM2's rename) and the lowest chat over lookup off from 0.89 and 0.99 to 0.96 and
# 1.00, with the grounded geometric means over ngram-simple within -2.4% to +2.5% per
# model; the one task it cost most, Gemma-3's quote in one table, went from 1.06x to
# 0.96x lookup off (ngram-simple's 0.93x). On the real engine, the two rules alternating
# on one model over 4 rounds of scripts/bench/bench_lookup.py's seven tasks (paired geometric
# means, new over old): SmolLM2's grounded tasks 1.02x (rename 1.04x), Gemma-3's 0.99x,
# their chats 1.00x and 1.02x.
NEAR_BEST = 0.985
MAX_MATCH = 64  # how far a match is extended backwards (longer says nothing more)
CANDIDATES = 8  # most recent occurrences of the pair examined per draft
# A shadow draft is judged once this many plain steps agreed with it (or at the first that
# did not): short, so that evidence for a band arrives within a few tokens.
SHADOW_TOKENS = 4
# A match at most 1/LOOP_REPEATS of its length back is a loop (the answer repeating a
# phrase): its draft goes on around the loop instead of stopping where the history ends.
# Replayed on the bench tasks' greedy answers with one table of measured step costs
# (scripts/lookup/replay_lookup.py), it took SmolLM2's quote (a four-token loop) from 1.50x to
# 1.98x lookup off's speed and Gemma-3's trip from 1.86x to 1.95x, and no task lower;
# without the guard, open chats drafted more tokens that failed.
LOOP_REPEATS = 2
# A draft behind a match that ends in the answer itself (not the prompt, not a loop) is a
# phrase the answer repeats, and a repeated phrase runs on for a while, then parts from
# its first telling: having agreed for m tokens, it agrees for k more with odds of about
# m / (m + k), on top of the band's acceptance. Replayed on four measured tables
# (scripts/lookup/replay_lookup.py --load), the lowest chat went from 0.91-0.96x lookup off to
# 0.99-1.00x (SmolLM2's bicycle had drafted a three-token phrase repeat at the rate of the
# code edits before it), while the grounded tasks' geometric mean over ngram-simple moved
# by -1.0% to +0.6%. Applied to every match, copies of the prompt included, it cost
# those 4-7%.
# Such a phrase is also priced by an acceptance of the answer's own phrases alone, not by
# what copies of given text (and of a proven loop) did: how often a model goes on
# repeating itself is the model's own habit, not what its code edits copied. Counted over
# every draft of 3 rounds of bench_lookup.py's tasks and the identity prompts, phrase
# repeats (match shorter than two of its periods) in chats kept 28 of 46 drafted tokens on
# SmolLM2-135M (which loops on a sentence and leaves it mid-lap), 264 of 355 on Qwen2.5 and
# 1279 of 1403 on Gemma-3, while the grounded tasks' copies of their prompts kept
# 0.87-0.91: one rate per band let SmolLM2 draft the next lap of its 8-token loop at the
# rate its code edits had earned (0.97), where its 33-token answer ended instead. So its
# slots start lower in the 9-16 band (OWN_PRIOR_RATE), and earlier answers' repeats may
# lower that start but never lift it. Its verdicts still count for copies of the same
# length, as every draft's did before: a 2-4-token match is chance wherever it was found,
# and priced by copies alone, Qwen2.5's trip drafted 6-18 tokens behind a 2-token match of
# its prompt at the code edits' 0.85-0.89 (0.948x lookup off by
# scripts/lookup/lookup_step_ledger.py; 0.983x with the sharing, 0.988x before own slots).
# Replayed on one measured table (scripts/lookup/replay_lookup.py --load, the last of 2 to 7
# rounds: 18 chat answers a model), SmolLM2's chats under 0.98x lookup off went from 2 of
# 18 (lowest 0.96) to none (lowest 0.99), and to 3 of 18 (0.92) with a copy's starts. The
# chats' geometric means moved 0.994 -> 0.998x, 1.918 -> 1.872x, 1.176 -> 1.152x
# (SmolLM2, Gemma-3, Qwen2.5), the grounded tasks' 1.630 -> 1.638x, 2.216 -> 2.236x,
# 2.083 -> 2.129x. Letting the model's record lift the start as for copies replayed as
# well (1.004x, 1.931x, 1.183x), but on the engine it drafted SmolLM2's bicycle again:
# 0.993x (0.974-1.013) against 0.997x (0.995-0.998) by the step ledger, 24 pairs.


def _band(match: int) -> int:
    for i, top in enumerate(BANDS):
        if match <= top:
            return i
    return len(BANDS) - 1


def _slot(match: int, own: bool) -> int:
    """Where a draft's acceptance is kept: its match-length band, the answer's own
    phrases apart from copies (see the note under LOOP_REPEATS)."""
    return _band(match) + (len(BANDS) if own else 0)


def slot_label(slot: int) -> str:
    """A _slot() as its band, "own" after it for a phrase of the answer's own."""
    return f"{slot % len(BANDS)}{'own' if slot >= len(BANDS) else ''}"


class NgramIndex:
    """Where each pair of neighbouring tokens occurred in a growing history."""

    def __init__(self) -> None:
        self._at: dict[tuple[int, int], list[int]] = {}  # pair -> indexes of its second token
        self._n = 0  # history tokens indexed so far

    def sync(self, history: list[int]) -> None:
        """Index the tokens appended since the last call (the history only ever grows)."""
        at = self._at
        for i in range(max(self._n, 1), len(history)):
            at.setdefault((history[i - 1], history[i]), []).append(i)
        self._n = len(history)

    def find(self, history: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest recent match of the history's tail,
        and the match's length (0: no earlier occurrence of the last two tokens)."""
        end, length = self.locate(history)
        if end < 0 or k <= 0:
            return [], 0
        return history[end + 1 : end + 1 + k], length

    def locate(self, history: list[int], edits: LearnedEdits | None = None,
               also: int | None = None) -> tuple[int, int]:
        """Where the longest recent earlier match of the history's tail ends, and its
        length ((-1, 0): no earlier occurrence of the last two tokens). With `edits`, a
        match goes on behind a spot where the answer made an edit it learned (a renamed
        name), counted on the answer's side. `also`: one more place to try first, the
        one the answer has just been copying (in code a pair like `last`, `_ts` recurs
        more often than the CANDIDATES most recent places reach back)."""
        self.sync(history)
        n = len(history)
        if n < 3:
            return -1, 0
        tail = history[-2], history[-1]
        places = self._at.get(tail)
        if not places:
            return -1, 0
        best = (-1, 0)
        seen = 0
        first = [also] if also is not None and 0 < also < n - 1 and (history[also - 1], history[also]) == tail else []
        for end in chain(first, reversed(places)):
            if end >= n - 1:  # the tail itself
                continue
            exact = 2
            while exact < MAX_MATCH and end - exact >= 0 and history[end - exact] == history[n - 1 - exact]:
                exact += 1
            length = exact if edits is None else edits.extend(history, n - 1 - exact, end - exact, exact, MAX_MATCH)
            if length > best[1]:
                best = (end, length)
            seen += 1
            if seen == CANDIDATES or length >= MAX_MATCH:
                break
        return best


def propose(history, min_n: int = 2, k: int = 8) -> list[int]:
    """What followed the longest recent earlier match (of at least min_n >= 2 tokens)
    of the history's tail; [] without one."""
    draft, match = NgramIndex().find(list(history), k)
    return draft if match >= max(2, min_n) else []


@dataclass
class LookupConfig:
    enabled: bool = True
    min_match: int = 2  # never draft behind a shorter match (a pair is the index key)
    max_draft: int = 48  # as llama-server's ngram-simple; a long copied span pays most in few steps
    # Cost of one more verified row, in single-token steps: with measure_cost=False, every
    # width's; otherwise the rows past StepCost.MAX_ROWS (StepCost's own prior for widths
    # not measured yet is this default's line, optimistic on purpose, so that long drafts
    # get tried and measured). Measured on this project's 2-core CPU: 17 rows cost 6.8
    # one-row steps on Gemma-3 (0.36 a row); on a GPU or Apple Silicon a row costs far less.
    cost_per_draft: float = 0.25
    min_gain: float = 1.05  # draft only when it is expected to pay at least this much
    measure_cost: bool = True  # False keeps cost_per_draft (deterministic draft lengths)
    # At temperature 0, take a wide step's greedy token only where it leads the runner-up
    # by more than the model's measured batch drift, else let a one-row step decide (see
    # the module's "Temperature 0"). Off by default: over 36 answers it kept about as
    # many identical to lookup off (29 and 28 against 27 and 28 in two same-run
    # measurements) while grounded tasks decoded 1.23-1.34x slower (scripts/bench/bench_lookup.py
    # --engines lr_lookup lr_exact ...).
    exact_greedy: bool = False
    # Drafts make the edits the answer made to what it copies (edits.LearnedEdits).
    # Measured on the typo-fixing task, the one of scripts/bench/bench_lookup.py's where the test
    # models edit what they copy (they write the renames back unrenamed): decode 1.05x /
    # 1.17x / 1.38x on Gemma-3 / SmolLM2 / Qwen2.5 against learn_edits=False (medians of 3,
    # `--engines lr_lookup lr_noedit`), steps per answer 12-15 instead of 24-25, 29 instead
    # of 44, 26 instead of 47.
    learn_edits: bool = True


class Acceptance:
    """Decayed accepted / judged draft tokens per match-length band. A band's rate starts
    from `PRIOR_RATE`, or from another Acceptance's (the model's: what its drafts did
    lately, over every answer), so that a session of code edits does not ramp up from
    scratch on every request. That record lifts the start only while this answer's drafts
    mostly pass: once half of them failed at their first token, it can only lower it. What
    a code edit copied says little about the next request when that is a chat (there the
    same short matches are chance), and failed wide steps are what lookup must not pay
    for. Measured (scripts/bench/bench_lookup.py's seven tasks in order, one process, 3-4 runs):
    never lifting the start cost Gemma-3's code edits 15-20%; always lifting it made
    SmolLM2's chats after the edits 0.83-0.90x lookup off. A phrase of the answer's own
    has slots of its own (_slot), whose start the model's record never lifts; its verdicts
    count for copies of its length too."""

    def __init__(self, prior: "Acceptance | None" = None) -> None:
        self.prior = prior
        self._hits = [0.0] * 2 * len(BANDS)  # per _slot()
        self._trials = [0.0] * 2 * len(BANDS)
        self._verdicts = [0, 0]  # drafts judged in any band, and how many of them failed at once

    def rate(self, slot: int) -> float:
        start = _STARTS[slot]
        if self.prior is not None:
            model = self.prior.rate(slot)
            # what earlier answers' own phrases did never lifts this one's start (see the
            # note under LOOP_REPEATS): that a poem went round its stanza says little of
            # whether this chat's sentence will be said once more
            lift = slot < len(BANDS) and self._copying()
            start = model if lift else min(start, model)
        return (self._hits[slot] + start * PRIOR_WEIGHT) / (self._trials[slot] + PRIOR_WEIGHT)

    def _copying(self) -> bool:
        """Whether this answer's drafts mostly passed so far (or none was judged yet)."""
        judged, failed = self._verdicts
        return judged < 2 or failed * 2 < judged

    def judged(self, slot: int, drafted: int, accepted: int) -> None:
        """Tokens after the first rejection were never judged: the trials are the accepted
        ones plus that one rejection."""
        # an own phrase's verdict counts for copies of its length too (see LOOP_REPEATS' note)
        for s in (slot, slot - len(BANDS)) if slot >= len(BANDS) else (slot,):
            self._hits[s] = DECAY * self._hits[s] + accepted
            self._trials[s] = DECAY * self._trials[s] + accepted + (1 if accepted < drafted else 0)
        self._verdicts[0] += 1
        self._verdicts[1] += accepted == 0
        if self.prior is not None:
            self.prior.judged(slot, drafted, accepted)


class LookupProposer(Offering):
    """One generation's drafting: acceptance per match-length band, and the length that
    pays most given the model's step cost."""

    def __init__(self, cfg: LookupConfig, cost: StepCost | None = None, model: Acceptance | None = None,
                 answer_start: int | None = None, spelling: TokenText | None = None,
                 control: frozenset[int] = frozenset()) -> None:
        """`cost` and `model` are the model's (shared by its generations): the measured
        step cost, and the acceptance its drafts had lately. `answer_start`: where the
        answer begins in the history (the prompt's length); None: every match is taken
        as a copy of given text. `spelling`: the vocabulary's tokens as bytes and text as
        tokens, for edits that mirror a dropped bracket (see LearnedEdits). `control`:
        the chat template's turn marks the prompt holds, which no draft holds (see
        draft())."""
        self.cfg = cfg
        self.answer_start = answer_start
        self.control = control
        self.cost = cost if cost is not None else StepCost()
        self.acceptance = Acceptance(prior=model)
        self.index = NgramIndex()
        self.edits = LearnedEdits(MAX_EDITS if cfg.learn_edits else 0, spelling)
        self.slot = -1  # the acceptance slot (_slot) of the draft in flight
        self.match = 0  # the match length the last draft() decided on
        self.priced = -1  # the slot the last draft() priced its draft by (-1: no match)
        self._flight: tuple[int, list] | None = None  # the draft in flight: history length, origins
        self._after: tuple[int, int] | None = None  # (answer, source) index of the token after a kept draft
        self._shadow: tuple[int, int, list[int]] | None = None  # slot, history length, tokens
        self._offered: tuple[int, list[int], list, int] | None = None  # history length, tokens, origins, slot

    def rate(self, slot: int) -> float:
        return self.acceptance.rate(slot)

    def row_cost(self, rows: int) -> float:
        return self.row_costs(rows)[rows]

    def row_costs(self, most: int) -> list[float]:
        """row_cost(r) for every r in 0..most, as a list (index r; 0 and 1 rows cost 1)."""
        if not self.cfg.measure_cost:
            per = self.cfg.cost_per_draft
            return [1.0] + [1.0 + per * (r - 1) for r in range(1, most + 1)]
        return self.cost.ratios(most, self.cfg.cost_per_draft)

    def draft(self, history: list[int], room: int, share: StepShare = ALONE) -> list[int]:
        """The tokens to verify after the pending one ([] for a plain step), priced in the
        step they would join (`share`)."""
        found = self._candidate(history, room)
        if found is None:
            return []
        candidate, slot, repeat_of = found
        return self.take(self.best_length(self.rate(slot), len(candidate), repeat_of=repeat_of, share=share))

    def offer(self, history: list[int], room: int) -> Offer | None:
        found = self._candidate(history, room)
        if found is None:
            return None
        candidate, slot, repeat_of = found
        expected = self.expected_tokens(self.rate(slot), len(candidate), repeat_of)
        return Offer(candidate, expected, self.cfg.min_gain, self.row_costs)

    def take(self, k: int) -> list[int]:
        start, candidate, origins, slot = self._offered
        self._offered = None
        if k == 0:
            if self._shadow is None:
                self._shadow = (slot, start, candidate[:SHADOW_TOKENS])
            return []
        self._shadow = None  # a real verdict comes now, over the same tokens
        self.slot = slot
        self._flight = (start, origins[:k])
        return candidate[:k]

    def _candidate(self, history: list[int], room: int) -> tuple[list[int], int, int | None] | None:
        """What the context offers to copy next, up to `room` tokens (kept for `take`):
        the tokens, their acceptance slot and, for a phrase of the answer's own, its match
        length; None when there is nothing to draft."""
        self.match, self.priced = 0, -1
        if not self.cfg.enabled or room <= 0:
            return None
        self._judge_shadow(history)
        resumed = None  # the source index the answer's last token copied, where known
        if self._after is not None:
            answer, source = self._after
            self._after = None
            if source < answer < len(history):
                if self.edits.copy(history, source, 1)[0] != [history[answer]]:
                    self.edits.missed(source, answer)
                elif answer == len(history) - 1:
                    resumed = source  # locate() tries it where its pair is the tail's
        self.edits.resync(history)
        end, match = self.index.locate(history, self.edits, also=resumed)
        self.match = match
        if match < self.cfg.min_match:
            return None
        period = len(history) - 1 - end  # how far back the match ends
        # past the history's end the draft goes on around the loop, once the tail has
        # shown it three times over (one repeat says little: a line that recurs once)
        loop = match >= LOOP_REPEATS * period
        candidate, origins = self.edits.copy(history, end + 1, min(room, self.cfg.max_draft), loop=loop)
        # A copy of the prompt that reaches the template's turn marks has left the message
        # it copied: an answer that echoes its question ("Sure, here are three ideas for a
        # weekend trip") goes on in its own words, not with "<|im_end|>". Drafted through
        # them, Qwen2.5's trip, asked alone, drafted 5-16 tokens there and kept one, every
        # answer; held back, 0.981x (0.970-0.992) -> 0.995x (0.988-1.003) and, rerun,
        # 0.988x (0.980-0.995) lookup off (scripts/lookup/lookup_step_ledger.py, 24 pairs; what
        # is left is " You" drafting "are a helpful assistant." from the system prompt,
        # none of it kept). Replayed (scripts/lookup/replay_lookup.py),
        # Qwen2.5's typos 1.15x -> 1.23x, SmolLM2's rename 1.41x -> 1.45x lookup off.
        if not self.control.isdisjoint(candidate):
            candidate = list(takewhile(lambda t: t not in self.control, candidate))
        if not candidate:
            return None
        repeat = self.answer_start is not None and end >= self.answer_start and not loop
        slot = self.priced = _slot(match, repeat)
        self._offered = (len(history), candidate, origins, slot)
        return candidate, slot, match if repeat else None

    def _judge_shadow(self, history: list[int]) -> None:
        """Judge the shadow draft once the tokens produced since it decide it."""
        if self._shadow is None:
            return
        slot, start, tokens = self._shadow
        produced = history[start : start + len(tokens)]
        agreed = 0
        while agreed < len(produced) and produced[agreed] == tokens[agreed]:
            agreed += 1
        if agreed == len(tokens) or agreed < len(produced):
            self.acceptance.judged(slot, len(tokens), agreed)
            self._shadow = None

    def best_length(self, rate: float, available: int, repeat_of: int | None = None,
                    share: StepShare = ALONE) -> int:
        """The shortest k in 0..available whose expected tokens per step time come within
        NEAR_BEST of the best k's, where k = 0 (a plain step: one token, cost 1) wins unless
        a draft beats it by min_gain.
        `repeat_of`: the draft continues a phrase of the answer's own that has agreed for
        that many tokens, and the k-th token's odds are scaled by repeat_of / (repeat_of + k)
        (see the note under LOOP_REPEATS).
        `share`: the step the draft joins; its other streams' tokens count in the step's
        yield and its passes in the step's cost (StepShare), so a draft that would pay alone
        may not pay in a step that four streams share."""
        best_k, best_gain = 0, self.cfg.min_gain
        gains = [0.0]
        others = share.tokens - 1
        costs = self.row_costs(available + share.rows)
        available = share.widest(costs, available)  # the others' bound (StepShare.widest)
        base = share.cost(costs, 0) / share.tokens  # alone: 1.0, and the gain below is expected / costs[k + 1]
        expected = self.expected_tokens(rate, available, repeat_of)
        for k in range(1, available + 1):
            gain = (others + expected[k]) * base / share.cost(costs, k)
            gains.append(gain)
            if gain > best_gain:
                best_k, best_gain = k, gain
        if best_k:  # the shortest length that pays nearly as much (see NEAR_BEST)
            enough = max(NEAR_BEST * best_gain, self.cfg.min_gain)
            best_k = next(k for k in range(1, best_k + 1) if gains[k] >= enough)
        return best_k

    @staticmethod
    def expected_tokens(rate: float, available: int, repeat_of: int | None = None) -> list[float]:
        """The tokens a step yields on average with k drafted, for k in 0..available:
        1 + rate + ... + rate**k, each term scaled by the phrase-repeat odds when the draft
        continues the answer's own text (`repeat_of`, see best_length)."""
        expected, term, total = [1.0], 1.0, 1.0
        for k in range(1, available + 1):
            term *= rate
            total += term if repeat_of is None else term * repeat_of / (repeat_of + k)
            expected.append(total)
        return expected

    def record(self, drafted: int, accepted: int) -> None:
        """The verdict on the draft in flight."""
        if not drafted or self.slot < 0:
            return
        self.acceptance.judged(self.slot, drafted, accepted)
        self.slot = -1
        if self._flight is not None:
            start, origins = self._flight
            if accepted < drafted:
                source, edit = origins[accepted]
                if edit is not None:
                    self.edits.forget(edit, source)  # the answer did not make that edit here
                self.edits.missed(source, start + accepted)
            else:  # the token after the draft may leave the copy too: the next draft looks
                source, edit = origins[-1]
                self._after = (start + drafted, source + (len(edit[0]) if edit else 1))
        self._flight = None

"""The Sampler: one generation's chain, RNG and mirostat state."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ..errors import BadRequestError
from . import stages
from .breakers import NO_BREAKERS, DryBreakers, TokenText
from .dry import dry_penalties
from .fused import FusedChain
from .mirostat import mirostat_v1, mirostat_v2
from .params import _ARGMAX_CHANGING, SamplingParams
from .stages import _Cands, _log_softmax, _softmax, _top_indices


# -- the sampler ---------------------------------------------------------------------


class Sampler:
    """One generation's sampler: the params, the RNG, mirostat's mu, and (for DRY's
    sequence breakers) the model's token text.

    `vocab` is a shared `TokenText` (best: built once per model, e.g.
    `TokenText.from_backend(backend)`), or what `TokenText` takes: a list of pieces or a
    function id -> bytes/str. Without it DRY still runs, but with no sequence breakers."""

    def __init__(
        self,
        params: SamplingParams,
        vocab: TokenText | Sequence[bytes | str] | Callable[[int], bytes | str] | None = None,
    ) -> None:
        self.params = params
        self.vocab = vocab if vocab is None or isinstance(vocab, TokenText) else TokenText(vocab)
        self._order = params.order
        self._pre = tuple(s for s in self._order if s in _ARGMAX_CHANGING)
        self._fused = FusedChain.plan(params)  # None: this chain always runs stage by stage
        self._breakers: DryBreakers | None = None
        self._n_row = 0  # the vocabulary size, from the row being sampled
        self._seed = params.seed if params.seed is not None and params.seed >= 0 else np.random.SeedSequence().entropy
        self.rng = np.random.Generator(np.random.PCG64(self._seed))
        self.mu = 2.0 * params.mirostat_tau

    # -- state, for speculation ----------------------------------------------------

    def snapshot(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "mu": self.mu}

    def restore(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.mu = state["mu"]

    def reset(self) -> None:
        """Back to the state at construction (same seed, mu = 2 tau)."""
        self.rng = np.random.Generator(np.random.PCG64(self._seed))
        self.mu = 2.0 * self.params.mirostat_tau

    # -- the chain -------------------------------------------------------------------

    def _stage(self, name: str, c: _Cands, history: Sequence[int]) -> None:
        p = self.params
        if name == "penalties":
            stages.apply_penalties(c, history, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty,
                                   p.presence_penalty)
        elif name == "dry":
            self._dry(c, history)
        elif name == "logit_bias":
            stages.apply_logit_bias(c, p.logit_bias)
        elif name == "top_n_sigma":
            stages.top_n_sigma(c, p.top_n_sigma)
        elif name == "top_k":
            stages.top_k(c, p.top_k)
        elif name == "typ_p":
            stages.typical(c, p.typical_p, p.min_keep)
        elif name == "top_p":
            stages.top_p(c, p.top_p, p.min_keep)
        elif name == "min_p":
            stages.min_p(c, p.min_p, p.min_keep)
        elif name == "xtc":
            stages.xtc(c, p.xtc_probability, p.xtc_threshold, p.min_keep, self.rng)
        elif name == "temperature":
            stages.temperature(c, p.temperature, p.dynatemp_range, p.dynatemp_exponent)

    def _dry(self, c: _Cands, history: Sequence[int]) -> None:
        p = self.params
        if not p.dry_on:
            return
        window = history if p.dry_penalty_last_n == -1 else history[-p.dry_penalty_last_n :]
        if len(window) <= p.dry_allowed_length:
            return
        if self._breakers is None:
            self._breakers = (
                self.vocab.breakers(p.dry_sequence_breakers, self._n_row) if self.vocab is not None else NO_BREAKERS
            )
        toks, pens = dry_penalties(
            np.asarray(window, dtype=np.int64), p.dry_multiplier, p.dry_base, p.dry_allowed_length, self._breakers
        )
        if toks.size:
            c.add(toks, -pens)

    def reweighs_only(self) -> bool:
        """Whether every stage of the chain changes each id's logit on its own (penalties,
        DRY, logit bias, a fixed temperature) and keeps every id. Then the chain's law
        over a grammar's allowed ids is its law over the whole row given that the draw
        lands among them, so a draw the grammar refuses may be taken out and drawn again
        (localrun.grammar.redraw) instead of masking the whole row first."""
        p = self.params
        if p.greedy or p.mirostat or p.dynatemp_range > 0:
            return False
        cuts = {"top_n_sigma": p.top_n_sigma > 0, "top_k": p.top_k > 0, "typ_p": p.typical_p < 1.0,
                "top_p": p.top_p < 1.0, "min_p": p.min_p > 0.0, "xtc": p.xtc_probability > 0.0}
        return not any(cuts.get(name, False) for name in self._order)

    def adjusted(self, row: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The row after the argmax-changing stages (penalties, DRY, logit bias), in the
        configured order; the backend's buffer is never written."""
        self._n_row = row.shape[0]
        c = _Cands(row)
        for name in self._pre:
            self._stage(name, c, history)
        return c.logits

    def grammar_head(self, row: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, int] | None:
        """For a grammar mask that only has to be right where the draw can land: the
        ids ranked by adjusted logit (best first, a head of 4x what is needed) and how
        many allowed ones the chain needs — 1 under greedy, k when top-k is the chain's
        first truncation (everything before it only adjusts logits). None when the chain
        needs the whole mask (mirostat, no top-k, or a truncation before it).

        Masking before top-k keeps the k best allowed ids; every later stage and the draw
        see only those. So a row where just those k ids keep their logits samples exactly
        like the fully masked row, and finding them takes ~1 us per id checked."""
        p = self.params
        if p.greedy:
            need = 1
        elif p.mirostat or p.top_k <= 0 or "top_k" not in self._order:
            return None
        else:
            cut = self._order.index("top_k")
            # top-n-sigma before top-k reads every allowed logit, so it needs the whole mask
            before = {s for s in self._order[:cut] if s != "top_n_sigma" or p.top_n_sigma > 0}
            if before != set(self._pre):
                return None
            need = p.top_k
        adjusted = self.adjusted(row, history)
        head = _top_indices(adjusted, min(4 * need, adjusted.shape[0]))
        return head[np.argsort(-adjusted[head], kind="stable")], need

    def distribution(self, row: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and float64 probabilities: exactly what the draw in `sample` uses,
        after every stage (for mirostat, after its truncation with the current mu).

        Consumes no randomness except XTC's coin, and changes no other state. Small sets
        (always, in the default chain) come sorted by descending probability; a chain
        that keeps more than 4096 tokens returns them in id order."""
        p = self.params
        if p.greedy:
            return np.array([int(np.argmax(self.adjusted(row, history)))]), np.array([1.0])
        if self._fused is not None:
            fused = self._fused.candidates(row, history, self._stage)
            if fused is not None:
                self._n_row = row.shape[0]
                return np.array(fused[0], dtype=np.int64), np.array(fused[1])
        return _finished(self._staged(row, history))

    def _staged(self, row: np.ndarray, history: Sequence[int]) -> _Cands:
        """The candidates after every stage of the chain (mirostat's truncation included)."""
        p = self.params
        n_vocab = self._n_row = row.shape[0]
        c = _Cands(row)
        if p.mirostat:
            for name in self._pre:
                self._stage(name, c, history)
            stages.temperature(c, p.temperature)
            if p.mirostat == 1:
                mirostat_v1(c, self.mu, n_vocab)
            else:
                mirostat_v2(c, self.mu)
        else:
            for name in self._order:
                self._stage(name, c, history)
        return c

    def draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        """One token from (ids, probs) with one uniform from the RNG; never a p=0 token."""
        cum = np.cumsum(probs)
        at = int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"))
        return int(ids[min(at, ids.size - 1)])

    def commit(self, token: int, ids: np.ndarray, probs: np.ndarray) -> None:
        """Record that `token` was emitted from the distribution (ids, probs): mirostat
        moves mu by eta times the token's surprise minus tau. A token outside the
        distribution (impossible unless chosen by something else) leaves mu alone."""
        p = self.params
        if not p.mirostat:
            return
        where = np.flatnonzero(ids == token)
        if where.size and probs[where[0]] > 0:
            self.mu -= p.mirostat_eta * (-math.log2(float(probs[where[0]])) - p.mirostat_tau)

    def sample(self, row: np.ndarray, history: Sequence[int]) -> int:
        """distribution + draw + commit; greedy is a plain argmax."""
        if self.params.greedy:
            return int(np.argmax(self.adjusted(row, history)))
        if self._fused is not None:  # drawn from without numpy (see fused.py)
            token = self._fused.draw(row, history, self._stage, self.rng.random)
            if token is not None:
                self._n_row = row.shape[0]
                return token
        c = self._staged(row, history)
        if c.ids is None and c.size > _SORTED_AT_MOST and not self.params.mirostat:
            # the whole row in id order, as `distribution` leaves it: the same draw without
            # an id array, normalising, nor a cumulative sum over every id (full-vocabulary
            # sampling over 152k ids: 2.1 -> ~0.3 ms a token here)
            x = c.logits
            return _draw_whole(np.exp(x - x.max()), self.rng.random())
        ids, probs = _finished(c)
        token = self.draw(ids, probs)
        self.commit(token, ids, probs)
        return token

    def candidates(self, row: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The old name of `distribution`."""
        return self.distribution(row, history)

    def token_prob(self, row: np.ndarray, token: int) -> float:
        """The raw softmax probability of one token (the `top_probs` "raw" scale)."""
        return math.exp(float(_log_softmax(row)[token]))

    def top_probs(self, row: np.ndarray, history: Sequence[int], n: int, which: str = "raw") -> list[tuple[int, float]]:
        """The n most likely tokens with their probabilities, most likely first.

        which="raw": softmax of the model's logits, what llama-server's `n_probs`
        reports by default; "adjusted": after penalties, DRY and logit bias, before any
        truncation; "final": the sampling distribution (llama-server's
        post_sampling_probs; it draws XTC's coin, so call it instead of, not beside,
        `distribution` when XTC is on)."""
        if n <= 0:
            return []
        if which == "final":
            ids, probs = self.distribution(row, history)
            top = np.argsort(-probs, kind="stable")[:n]
            return [(int(ids[i]), float(probs[i])) for i in top]
        if which not in ("raw", "adjusted"):
            raise BadRequestError(f"top_probs: which must be 'raw', 'adjusted' or 'final', got {which!r}")
        logits = row if which == "raw" else self.adjusted(row, history)
        top = _top_indices(logits, min(n, logits.shape[0]))
        top = top[np.argsort(-logits[top], kind="stable")]
        logp = _log_softmax(logits)
        return [(int(t), math.exp(float(logp[t]))) for t in top]


_SORTED_AT_MOST = 4096  # a distribution of at most this many ids comes sorted (see Sampler.distribution)


def _finished(c: _Cands) -> tuple[np.ndarray, np.ndarray]:
    """(ids, float64 probabilities) of the candidates left after the chain."""
    if not c.sorted and c.size <= _SORTED_AT_MOST:
        c.sort()
    return c.id_array(), _softmax(c.logits)


_BLOCK = 1024  # ids a block of _draw_whole


def _draw_whole(weights: np.ndarray, u: float) -> int:
    """The id a uniform `u` picks from float32 `weights` (>= 0, not all 0), as `draw`
    picks it from their cumulative sum: the first id whose running total (in float64)
    exceeds u times the whole. The running total over every id is a sequential pass
    (~0.5 ms over 152k here), so the blocks' sums come first, then one block's running
    total (~0.1 ms). Never an id of weight 0 (float rounding between the two sums could
    otherwise land the pick on one at a block's end)."""
    n = weights.shape[0]
    whole = n - n % _BLOCK
    sums = weights[:whole].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    if whole < n:
        sums = np.append(sums, weights[whole:].sum(dtype=np.float64))
    cum = np.cumsum(sums)
    target = u * cum[-1]
    b = int(np.searchsorted(cum, target, side="right"))
    if b == cum.size:  # u so near 1 that its product rounded to the whole: the last block that weighs
        b = int(np.flatnonzero(sums)[-1])
    block = weights[b * _BLOCK : (b + 1) * _BLOCK]
    inner = np.cumsum(block, dtype=np.float64)
    i = min(int(np.searchsorted(inner, target - (cum[b - 1] if b else 0.0), side="right")), block.size - 1)
    if block[i] == 0:
        live = np.flatnonzero(block)
        i = int(live[max(0, np.searchsorted(live, i) - 1)])
    return b * _BLOCK + i

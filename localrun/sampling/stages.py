"""The candidate set and the truncation/temperature stages of the chain (penalties,
logit bias, top-n-sigma, top-k, typical, top-p, min-p, XTC, temperature). Each stage
takes the values it needs, not SamplingParams."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

try:  # the top-k in one C pass (_topk.c); a machine that built without a C compiler has numpy's
    from ._topk import top_k as _native_top_k, top_k_draw as _native_top_k_draw
except ImportError:
    _native_top_k = _native_top_k_draw = None

# Up to this k the C pass's heap stays small (it sorts what it keeps, too).
_NATIVE_MAX_K = 1024


# -- candidates ----------------------------------------------------------------------


# Below this many logits a row copy (~20 us for 49k) costs less than the patch's few
# small numpy calls; above it (a 262k row: ~100 us from memory) the patch wins.
_PATCH_MIN_ROW = 100_000


class _Cands:
    """The live candidate set: token ids (None = the whole vocabulary, id == index), their
    logits, and whether they are sorted by descending logit. The backend's row is never
    written: `own()` copies before the first in-place change.

    On a whole vocabulary of _PATCH_MIN_ROW or more, new logits for a few ids (penalties
    on a 64-token window, DRY, logit bias: `set_at`) wait in a patch instead of copying
    the row (~0.1-0.5 ms on 262k): top-k reads the row and the patch as they are, and
    anything else that reads `logits` writes the patch into a copy first."""

    __slots__ = ("ids", "_logits", "sorted", "owned", "_patch")

    def __init__(self, row: np.ndarray) -> None:
        self.ids: np.ndarray | None = None
        self._logits = row
        self.sorted = False
        self.owned = False
        self._patch: tuple[np.ndarray, np.ndarray] | None = None  # (sorted positions, float32 logits)

    @property
    def logits(self) -> np.ndarray:
        if self._patch is not None:
            pos, vals = self._patch
            self._patch = None
            self.own()
            self._logits[pos] = vals
        return self._logits

    @logits.setter
    def logits(self, value: np.ndarray) -> None:
        self._patch = None  # a new array is computed from `logits`, patch included
        self._logits = value

    @property
    def size(self) -> int:
        return self._logits.shape[0]

    def id_array(self) -> np.ndarray:
        return np.arange(self.size) if self.ids is None else self.ids

    def own(self) -> None:
        if not self.owned:
            self._logits = np.array(self._logits, dtype=np.float32, copy=True)
            self.owned = True

    def values_at(self, pos: np.ndarray) -> np.ndarray:
        """float32 logits at positions `pos`, the patch included, as a new array."""
        vals = self._logits[pos].astype(np.float32)
        if self._patch is not None and pos.size:
            ppos, pvals = self._patch
            at = np.minimum(np.searchsorted(ppos, pos), ppos.size - 1)
            hit = ppos[at] == pos
            vals[hit] = pvals[at[hit]]
        return vals

    def set_at(self, pos: np.ndarray, vals: np.ndarray) -> None:
        """New logits (cast to float32) for the distinct positions `pos`."""
        vals = np.asarray(vals).astype(np.float32)
        self.sorted = False
        if self.ids is not None or self.owned or self.size < _PATCH_MIN_ROW:
            self.own()
            self.logits[pos] = vals
            return
        if self._patch is not None:  # the later value of a position wins
            pos = np.concatenate([pos, self._patch[0]])
            vals = np.concatenate([vals, self._patch[1]])
        pos, first = np.unique(pos, return_index=True)
        self._patch = (pos, vals[first])

    def keep(self, idx: np.ndarray, is_sorted: bool) -> None:
        """Keep positions idx (an index array or a mask), in that order."""
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        self.logits = self.logits[idx]
        self.ids = idx if self.ids is None else self.ids[idx]
        self.owned = True
        self.sorted = is_sorted

    def keep_prefix(self, n: int) -> None:
        """Keep the first n (of a sorted set): views, no gather."""
        if n < self.size:
            self.logits = self.logits[:n]
            self.ids = np.arange(n) if self.ids is None else self.ids[:n]

    def sort(self) -> None:
        if not self.sorted:
            self.keep(np.argsort(-self.logits, kind="stable"), True)

    def _patched_head(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Sorted ids and patched logits of a superset of the top k: the row's top
        k + (patched ids), plus the patched ids. Any unpatched id in the top k is in the
        row's top k + m, since at most m of those were patched."""
        pos = self._patch[0]
        cand = np.union1d(_top_indices(self._logits, min(k + pos.size, self.size)), pos)
        return cand, self.values_at(cand)

    def top(self, k: int) -> None:
        """Keep the k largest logits, sorted descending."""
        if self._patch is not None and self.ids is None and k < self.size:
            cand, vals = self._patched_head(k)
            self._patch = None
            if cand.size > k:
                sel = _top_indices(vals, k)
                cand, vals = cand[sel], vals[sel]
            self.ids, self._logits, self.owned, self.sorted = cand, vals, True, False
        elif k < self.size:
            self.keep(_top_indices(self.logits, k), False)
        self.sort()

    def positions(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in the set, indices into `tokens`) of the tokens present."""
        if self.ids is None:
            sel = np.flatnonzero((tokens >= 0) & (tokens < self.size))
            return tokens[sel], sel
        order = np.argsort(self.ids, kind="stable")
        at = np.minimum(np.searchsorted(self.ids, tokens, sorter=order), self.size - 1)
        sel = np.flatnonzero(self.ids[order[at]] == tokens)
        return order[at[sel]], sel

    def add(self, tokens: np.ndarray, deltas: np.ndarray) -> None:
        """Add deltas to the logits of distinct tokens (those outside the set are skipped)."""
        pos, sel = self.positions(tokens)
        if pos.size:
            self.set_at(pos, self.values_at(pos) + deltas[sel].astype(np.float32))


# One pass over a row costs ~15 us from cache but ~120 us from memory (a fresh 262k row on
# a busy machine), so top-k reads the whole row once and then only what can be in the top.
_TOP_GROUPS = 4096  # column maxima of a 262k row: 64 rows of 4096; few enough to partition


_HEAD_BLOCKS = 64  # blocks of column maxima whose maxima bound the top k cheaply (k <= 64)


def _head_columns(maxima: np.ndarray, k: int) -> tuple[float, np.ndarray]:
    """A lower bound on the k-th largest logit of the row whose column maxima these
    are, and the columns whose maximum reaches it: the only ones that can hold a top-k
    logit. Maxima of disjoint blocks of columns are distinct logits too, so the k-th
    largest of 64 block maxima is such a bound. It lets about twice k columns through
    instead of k (Gemma-3's rows, k = 40: median 86, at most 153 over 300 tokens), but
    a 64-element partition takes the place of a 4096-element one (42 us from cache).
    Where it lets too many through (ties, a grammar-masked row), the k-th largest
    column maximum is the bound."""
    groups = maxima.shape[0]
    if k <= _HEAD_BLOCKS and groups % _HEAD_BLOCKS == 0:
        blocks = maxima.reshape(_HEAD_BLOCKS, -1).max(axis=1)
        bound = np.partition(blocks, _HEAD_BLOCKS - k)[_HEAD_BLOCKS - k]
        if bound > -np.inf:
            cols = np.flatnonzero(maxima >= bound)
            if cols.size <= 8 * k:
                return bound, cols
    bound = np.partition(maxima, groups - k)[groups - k]
    return bound, np.flatnonzero(maxima >= bound)


def _top_indices(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, unordered, reading the row once: the C pass
    where it is built and takes the row, else numpy's:

    View the row as a (width, groups) matrix: the column maxima (one vectorised pass:
    an elementwise max of its rows) are `groups` distinct elements, so a lower bound on
    the row's k-th largest comes from them (_head_columns), and only the columns whose
    maximum reaches it can hold one: those (about 2k), plus the few ids past the last
    whole row, are all that is read again."""
    n = logits.shape[0]
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    if (_native_top_k is not None and k <= _NATIVE_MAX_K and n >= 8 * k and logits.ndim == 1
            and logits.dtype == np.float32 and logits.flags.c_contiguous):
        top = _native_top_k(logits, k)
        if top is not None:  # None: a NaN, or a grammar-masked row (numpy's way below)
            return np.array(top[0], dtype=np.int64)
    groups = max(4 * k, min(_TOP_GROUPS, n // 16))
    if n < 8 * groups:
        cand = np.arange(n)
    else:
        width = n // groups
        body = logits[: width * groups].reshape(width, groups)
        bound, cols = _head_columns(body.max(axis=0), k)
        if bound == -np.inf:  # a grammar-masked row: the allowed ids, then any -inf to make up k
            cand = np.flatnonzero(logits > bound)
            if cand.size < k:
                return np.concatenate([cand, np.flatnonzero(logits == bound)[: k - cand.size]])
        else:
            rows, at = np.nonzero(body[:, cols] >= bound)
            cand = rows * groups + cols[at]
            past = np.flatnonzero(logits[width * groups :] >= bound)
            if past.size:
                cand = np.concatenate([cand, past + width * groups])
    if cand.size > k:  # cand ascends, so of the ties at the k-th value the lowest ids stay (as the C pass)
        vals = logits[cand]
        kth = np.partition(vals, cand.size - k)[cand.size - k]
        above, tied = np.flatnonzero(vals > kth), np.flatnonzero(vals == kth)
        if above.size + tied.size >= k:
            return np.concatenate([cand[above], cand[tied[: k - above.size]]])
        cand = cand[np.argpartition(vals, cand.size - k)[cand.size - k :]]  # a NaN among them: any k
    return cand


def _softmax(logits: np.ndarray) -> np.ndarray:
    """float64 probabilities; exp in float32 (as llama.cpp's expf: 40x cheaper than
    float64 over a 262k row), normalised in float64 so they sum to 1 tightly."""
    x = np.asarray(logits, dtype=np.float32)
    e = np.exp(x - x.max()).astype(np.float64)
    return e / e.sum()


def _logsumexp(x: np.ndarray) -> float:
    m = x.max()
    return float(m) + math.log(float(np.exp(x - m).sum()))  # numpy sums pairwise: accurate


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32)
    return x.astype(np.float64) - _logsumexp(x)


def _mass_head(logits: np.ndarray, p: float) -> np.ndarray:
    """Positions of the shortest set of largest logits whose probability mass reaches p,
    sorted descending, without sorting the whole row: bucket the logits by distance from
    the max, find the bucket where the cumulative mass crosses p, sort only up to it."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max()
    e = np.exp(x - m)
    total = float(e.sum(dtype=np.float64))
    bucket = np.minimum((m - x) * np.float32(256 / 32), 255).astype(np.int64)  # 1/8 nat wide
    cum = np.cumsum(np.bincount(bucket, weights=e, minlength=256)) / total
    last = min(int(np.searchsorted(cum, p, side="left")), 255)
    cand = np.flatnonzero(bucket <= last)
    cand = cand[np.argsort(-x[cand], kind="stable")]
    n = int(np.searchsorted(np.cumsum(e[cand], dtype=np.float64) / total, p, side="left")) + 1
    return cand[: min(n, cand.size)]


# -- stages: each takes the candidate set and changes it in place ---------------------


def apply_penalties(
    c: _Cands, history: Sequence[int], last_n: int, repeat: float, frequency: float, presence: float
) -> None:
    """llama.cpp semantics over the last `last_n` tokens (-1: all, 0: off): repetition
    divides a positive logit and multiplies a non-positive one; presence subtracts once
    per seen token, frequency once per occurrence."""
    if last_n == 0 or (repeat == 1.0 and frequency == 0.0 and presence == 0.0):
        return
    window = history if last_n == -1 else history[-last_n:]
    if len(window) == 0:
        return
    toks, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    pos, sel = c.positions(toks)
    if not pos.size:
        return
    vals = c.values_at(pos)
    if repeat != 1.0:
        vals = np.where(vals <= 0, vals * repeat, vals / repeat)
    c.set_at(pos, vals - counts[sel] * frequency - presence)


def apply_logit_bias(c: _Cands, bias: dict[int, float]) -> None:
    if bias:
        c.add(np.fromiter(bias.keys(), np.int64, len(bias)), np.fromiter(bias.values(), np.float64, len(bias)))


def top_n_sigma(c: _Cands, n: float) -> None:
    """Keep the tokens whose logit is at least max - n * sigma, sigma the standard
    deviation of the finite logits (llama.cpp's top-n-sigma; n <= 0 = off). It never
    drops the top token, so greedy skips it. Costs two passes over the candidates."""
    if n <= 0 or c.size <= 1:
        return
    x = np.asarray(c.logits, dtype=np.float32)
    finite = x[x != -np.inf]  # llama.cpp leaves -inf (masked, banned) out of the statistics
    if not finite.size:
        return
    sigma = float(np.std(finite, dtype=np.float64))
    keep = x >= float(finite.max()) - n * sigma
    if not keep.all():
        c.keep(keep, c.sorted)


def top_k(c: _Cands, k: int) -> None:
    if 0 < k < c.size:
        c.top(k)


def typical(c: _Cands, p: float, min_keep: int) -> None:
    """Locally typical: keep the tokens whose surprise is closest to the entropy until
    their mass exceeds p."""
    if p >= 1.0 or c.size <= 1:
        return
    c.sort()  # ties in the score then break by logit, as after llama.cpp's sort
    logp = _log_softmax(c.logits)
    probs = np.exp(logp)
    entropy = -float(np.sum(probs[probs > 0] * logp[probs > 0]))
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    over = np.flatnonzero(np.cumsum(probs[order]) > p)
    n = c.size if not over.size else max(int(over[0]) + 1, min_keep)
    c.keep(np.sort(order[:n]), True)  # back in logit order: later stages expect it


def top_p(c: _Cands, p: float, min_keep: int) -> None:
    """Keep the shortest sorted prefix whose mass reaches p (at least min_keep)."""
    if p >= 1.0 or c.size <= 1:
        return
    if not c.sorted and c.size > 4096:  # e.g. top-k off: never sort the whole row
        head = _mass_head(c.logits, p)
        if head.size >= min_keep:
            c.keep(head, True)
            return
    c.sort()
    cum = np.cumsum(_softmax(c.logits))
    c.keep_prefix(max(int(np.searchsorted(cum, p, side="left")) + 1, min_keep))


def min_p(c: _Cands, p: float, min_keep: int) -> None:
    """Keep tokens with probability >= p times the top one's: logit >= max + ln p."""
    if p <= 0.0 or c.size <= 1:
        return
    x = c.logits
    keep = x >= (x[0] if c.sorted else x.max()) + math.log(p)
    n = int(np.count_nonzero(keep))
    if n >= max(min_keep, 1):
        if n < c.size:
            if c.sorted:  # the kept ones are a prefix
                c.keep_prefix(n)
            else:
                c.keep(keep, False)
    else:
        c.sort()
        c.keep_prefix(min_keep)


def xtc(c: _Cands, probability: float, threshold: float, min_keep: int, rng: np.random.Generator) -> None:
    """Exclude top choices: with chance `probability`, drop every token with p >= threshold
    except the least likely of them, if at least two qualify. The coin is drawn only when
    the stage can act (as llama.cpp: probability > 0, threshold <= 0.5, two candidates)."""
    if probability <= 0.0 or threshold > 0.5 or c.size < 2:
        return
    if rng.random() > probability:
        return
    c.sort()
    n_top = int(np.count_nonzero(_softmax(c.logits) >= threshold))  # sorted: a prefix
    drop = n_top - 1
    if drop > 0 and c.size - drop >= min_keep:
        c.keep(np.arange(drop, c.size), True)  # sorted: a suffix


def temperature(c: _Cands, t: float, dyn_range: float = 0.0, exponent: float = 1.0) -> None:
    """Divide by t; with dyn_range > 0, t moves within [t - range, t + range] with the
    normalised entropy of the candidates (llama.cpp's temp-ext)."""
    if dyn_range > 0:
        if c.size <= 1:
            return
        lo, hi = max(0.0, t - dyn_range), t + dyn_range
        probs = _softmax(c.logits)
        nz = probs[probs > 0]
        entropy = -float(np.sum(nz * np.log(nz)))
        normalised = min(entropy / math.log(c.size), 1.0)  # rounding may pass 1: a power of it could overflow
        t = lo + (hi - lo) * normalised**exponent
    if t <= 0:  # only the argmax survives
        c.keep(np.array([int(np.argmax(c.logits))]), True)
    elif t != 1.0:
        c.logits = c.logits / np.float32(t)
        c.owned = True

"""The chain's fused path: penalties -> top-k -> top-p / min-p / temperature in a few
numpy calls, for the chains most requests use (llama-server's default, with or without
a repetition penalty), on rows of a whole vocabulary.

Why a second path: right after a decode the CPU's caches hold the model's weights, not
this code or numpy's, so each distinct numpy call costs ~20-40 us the first time in a
token (measured in the engine loop on Gemma's 262k row: the staged chain took ~600 us
there, the same call a second time on the same row ~240 us). Cost here is the number of
distinct calls, not the work. So this path:

* penalises the repeated tokens inside the row itself, through a memoryview, and puts
  the old values back before it returns (the caller's row is unchanged afterwards; a
  read-only row is copied first): no patch bookkeeping, no np.unique;
* finds the top k with one call: _topk.c's single pass (a heap of the best k and a
  vectorised "anything above its worst?" test per block of the row), or, where no C
  compiler built that, with numpy: one pass for the column maxima of a (rows, 4096)
  view, a bound on the k-th largest from 64 maxima of those, and a gather of the few
  columns that reach it;
* runs top-p, min-p, temperature and the draw over the k sorted candidates, in the
  same C call where it is built (`draw`: one call, no Python float per candidate),
  else in Python floats: the cuts and roundings are the staged functions' (`stages.py`), the
  exponentials run in float64 instead of float32, so a probability may differ in its
  7th digit, and the candidates and draws are the staged chain's except where a top-p
  cut or a uniform falls within that of a boundary (tests/test_sampling_fused.py).

A grammar-masked row with fewer than k allowed tokens takes this path too, with those
tokens as its candidates (the staged chain's top-k would make up k with -inf logits,
each of probability zero). Anything else (mirostat, a truncation before top-k, typical,
XTC that can fire, top-n-sigma, dynamic temperature, no top-k, a small row) uses the
staged chain.
DRY and logit bias still work here: they run as stages on a `_Cands` and their patch
goes into the row the same way.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from itertools import accumulate
from typing import Callable, Sequence

import numpy as np

from .params import _ARGMAX_CHANGING, SamplingParams
from .stages import _Cands, _head_columns, _native_top_k, _native_top_k_draw

# columns of the top-k view: 4096 maxima are cheap to partition, and a 262k row is 64
# rows of them (49k: 12). Below MIN_ROW the staged chain is as fast.
GROUPS = 4096
MIN_ROW = 4 * GROUPS
MAX_K = 1024  # the bound stays tight while k is well under GROUPS
_TOP_P, _MIN_P, _TEMPERATURE = 1, 2, 3


def _active(name: str, p: SamplingParams) -> bool:
    """Whether the stage `name` changes anything under p (an inactive stage draws no
    randomness either: XTC draws its coin only when it can act)."""
    return {
        "penalties": p.repeat_last_n != 0 and (p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0),
        "dry": p.dry_on,
        "logit_bias": bool(p.logit_bias),
        "top_n_sigma": p.top_n_sigma > 0,
        "top_k": True,
        "typ_p": p.typical_p < 1.0,
        "top_p": p.top_p < 1.0,
        "min_p": p.min_p > 0.0,
        "xtc": p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5,
        "temperature": p.temperature != 1.0 or p.dynatemp_range > 0,
    }[name]


def _floats(row: np.ndarray) -> memoryview:
    """The row as a memoryview of C floats (ctypes' buffers say '<f', which memoryview
    cannot index: cast through bytes)."""
    mv = memoryview(row)
    return mv if mv.format == "f" else mv.cast("B").cast("f")


class FusedChain:
    """The fused plan for one SamplingParams: `plan(params)` is None when the chain
    needs the staged path. `candidates(row, history, stage)` returns what
    `Sampler.distribution` would, as lists, or None for a row it does not take (then the caller
    runs the staged chain); `stage(name, cands, history)` runs one pre-top-k stage
    (DRY, logit bias) on a `_Cands`."""

    __slots__ = ("k", "pre", "lean", "tail")

    def __init__(self, k: int, pre: tuple[str, ...], lean: tuple | None, tail: tuple) -> None:
        self.k = k
        self.pre = pre  # active pre-top-k stages run on a _Cands (DRY or logit bias among them)
        self.lean = lean  # (last_n, repeat as float32, frequency, presence): penalties alone
        self.tail = tail  # ((op, value, min_keep), ...) after top-k, in order

    @classmethod
    def plan(cls, p: SamplingParams) -> "FusedChain | None":
        order = p.order
        if p.mirostat or p.greedy or not 0 < p.top_k <= MAX_K or len(set(order)) != len(order) or "top_k" not in order:
            return None
        cut = order.index("top_k")
        pre = tuple(s for s in order[:cut] if _active(s, p))
        after = tuple(s for s in order[cut + 1 :] if _active(s, p))
        if any(s not in _ARGMAX_CHANGING for s in pre) or p.dynatemp_range > 0:
            return None
        if any(s not in ("top_p", "min_p", "temperature") for s in after):
            return None
        tail = []
        for s in after:
            if s == "top_p":
                tail.append((_TOP_P, p.top_p, p.min_keep))
            elif s == "min_p":
                tail.append((_MIN_P, np.float32(math.log(p.min_p)), p.min_keep))
            else:
                tail.append((_TEMPERATURE, float(np.float32(p.temperature)), 0))
        lean = None
        if pre == ("penalties",):
            lean = (p.repeat_last_n, float(np.float32(p.repeat_penalty)), p.frequency_penalty, p.presence_penalty)
            pre = ()
        return cls(p.top_k, pre, lean, tuple(tail))

    # -- the path ----------------------------------------------------------------------

    def candidates(
        self, row: np.ndarray, history: Sequence[int], stage: Callable[[str, _Cands, Sequence[int]], None]
    ) -> tuple[list[int], list[float]] | None:
        return self._run(row, history, stage, None)

    def draw(self, row: np.ndarray, history: Sequence[int], stage: Callable[[str, _Cands, Sequence[int]], None],
             random: Callable[[], float]) -> int | None:
        """The id `candidates` and a draw with u = random() give (Sampler.sample's draw),
        or None (random() not called) for a row this path does not take."""
        return self._run(row, history, stage, random)

    def _run(self, row: np.ndarray, history: Sequence[int], stage, random: Callable[[], float] | None):
        """`candidates` without `random`; with it, `draw`."""
        if row.ndim != 1 or row.dtype != np.float32 or row.shape[0] < MIN_ROW or not row.flags.c_contiguous:
            return None
        work, saved = row, None
        if self.pre:
            c = _Cands(row)
            for name in self.pre:
                stage(name, c, history)
            if c.owned:  # a private copy with every change in it
                work = c.logits
            elif c._patch is not None:
                work = row if row.flags.writeable else row.copy()
                saved = self.write(work, *c._patch)
        elif self.lean is not None:
            work = row if row.flags.writeable else row.copy()
            saved = self.penalise(work, history)
        try:
            if random is not None and _native_top_k_draw is not None:
                token = _native_top_k_draw(work, self.k, self.tail, random)
                # None: a NaN, or fewer than k allowed ids: those, as `top` finds them
                top = None if token is not None else self.allowed(work)
            else:
                token, top = None, self.top(work)
        finally:
            if saved is not None and work is row:
                self.restore(row, saved)
        if token is not None:
            return token
        if top is None:  # a row with a NaN, or with no allowed token
            return None
        ids, probs = self.truncate(*top)
        if random is None:
            return ids, probs
        cum = list(accumulate(probs))  # np.cumsum's sums, one at a time
        return ids[min(bisect_right(cum, random() * cum[-1]), len(cum) - 1)]

    def penalise(self, row: np.ndarray, history: Sequence[int]) -> tuple[list[int], list[float]] | None:
        """llama.cpp's repetition, frequency and presence penalties written into the row
        (float32 results, as `stages.apply_penalties` computes them: a float32 product
        or quotient rounds once from the exact double; the frequency and presence terms
        are subtracted in float64, then rounded). Returns the ids and their old values."""
        last_n, repeat, frequency, presence = self.lean
        window = history if last_n == -1 else history[-last_n:]
        if not len(window):
            return None
        n = row.shape[0]
        mv = _floats(row)
        ids: list[int] = []
        old: list[float] = []
        if frequency == 0.0 and presence == 0.0:
            for t in dict.fromkeys(window):  # distinct, in first-seen order
                if 0 <= t < n:
                    v = mv[t]
                    mv[t] = v * repeat if v <= 0 else v / repeat
                    ids.append(t)
                    old.append(v)
            return ids, old
        counts: dict[int, int] = {}
        for t in window:
            counts[t] = counts.get(t, 0) + 1
        for t, count in counts.items():
            if 0 <= t < n:
                v = mv[t]
                if repeat != 1.0:
                    mv[t] = v * repeat if v <= 0 else v / repeat
                mv[t] = mv[t] - count * frequency - presence
                ids.append(t)
                old.append(v)
        return ids, old

    @staticmethod
    def write(row: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        old = row[pos]
        row[pos] = vals
        return pos, old

    @staticmethod
    def restore(row: np.ndarray, saved: tuple) -> None:
        ids, old = saved
        if isinstance(ids, list):
            mv = _floats(row)
            for t, v in zip(ids, old):
                mv[t] = v
        else:
            row[ids] = old

    def top(self, row: np.ndarray) -> tuple[list[int], list[float]] | None:
        """The k largest logits, sorted descending (ties: the lower id first), and their
        ids: the C module's one pass where it is built (_topk.c), else numpy's; for a
        grammar-masked row with fewer than k logits above -inf, those (`allowed`). None
        for a row with a NaN or none allowed."""
        top = _native_top_k(row, self.k) if _native_top_k is not None else self.top_numpy(row)
        return top if top is not None else self.allowed(row)

    def allowed(self, row: np.ndarray) -> tuple[list[int], list[float]] | None:
        """A grammar-masked row's logits above -inf, sorted as `top` sorts, when there are
        fewer than k: what the staged chain keeps with a probability above zero (its
        top-k makes up k with -inf logits, which every later cut and the draw pass by).
        Two numpy passes where the staged chain made a dozen calls (~0.3 ms a token with
        a grammar in a tight spot). None where a NaN, not the mask, is the reason."""
        ids = np.flatnonzero(row != -np.inf)  # a NaN stays in sight, to be refused below
        if not 0 < ids.size < self.k:
            return None
        values = row[ids]
        if np.isnan(values).any():
            return None
        order = np.argsort(-values, kind="stable")
        return ids[order].tolist(), values[order].tolist()

    def top_numpy(self, row: np.ndarray) -> tuple[list[int], list[float]] | None:
        """`top` in numpy. View the row as (rows, GROUPS): one pass for the column
        maxima, then only the columns whose maximum can reach the top k are read again
        (_head_columns)."""
        k, n = self.k, row.shape[0]
        width = n // GROUPS
        body = row[: width * GROUPS].reshape(width, GROUPS)
        bound, cols = _head_columns(body.max(axis=0), k)
        if not bound > -np.inf:  # fewer than k finite logits in sight (grammar-masked), or NaN
            return None
        at_row, at_col = np.nonzero(body.take(cols, axis=1) >= bound)
        ids = at_row * GROUPS + cols[at_col]  # ascending, so a stable sort puts the lower id first
        if n > width * GROUPS:  # the ids past the last whole row of columns
            ids = np.concatenate([ids, width * GROUPS + np.flatnonzero(row[width * GROUPS :] >= bound)])
        values = row[ids]
        best = np.argsort(-values, kind="stable")[:k]
        return ids[best].tolist(), values[best].tolist()

    def truncate(self, ids: list[int], x: list[float]) -> tuple[list[int], list[float]]:
        """Top-p, min-p and temperature on sorted candidates (Python floats holding
        float32 logits), then the final probabilities. The cuts are the staged
        functions' (`stages.top_p`, `min_p`, `temperature`): min-p's threshold and
        temperature's quotients round to float32 as there; exponentials run in float64
        here (float32 there), so a probability may differ in its 7th digit."""
        exp = math.exp
        for op, value, min_keep in self.tail:
            if op == _TEMPERATURE:
                x = array("f", [v / value for v in x]).tolist()  # one float32 rounding each
                continue
            if len(x) <= 1:
                continue
            if op == _TOP_P:
                top = x[0]
                cum = list(accumulate([exp(v - top) for v in x]))
                reach = value * cum[-1]
                n = next((i for i, c in enumerate(cum) if c >= reach), len(x) - 1) + 1
                n = max(n, min_keep)
            else:  # min-p: the kept logits are a prefix
                threshold = float(np.float32(x[0]) + value)
                n = sum(1 for v in x if v >= threshold)
                if n < max(min_keep, 1):
                    n = min_keep
            if n < len(x):
                ids, x = ids[:n], x[:n]
        top = x[0]
        e = [exp(v - top) for v in x]
        total = math.fsum(e)
        return ids, [v / total for v in e]

"""The sampler chain, shared by every backend, applied to one numpy logits row.

Parameter names and meanings are llama-server's. Default order (`DEFAULT_SAMPLERS`):

    penalties -> dry -> logit_bias -> top_k -> typ_p -> top_p -> min_p -> xtc -> temperature -> draw

`samplers` overrides the order with llama-server's names ("penalties", "dry", "top_k",
"typ_p", "top_p", "min_p", "xtc", "temperature"; aliases "typical_p", "typical",
"nucleus", "temp"; "logit_bias" may be placed too, else it goes right after the leading
penalties/dry). A stage left out of the list is off, as in llama-server.

* Greedy (temperature <= 0, mirostat off) is an argmax after the argmax-changing stages
  (penalties, DRY, logit bias, applied to the whole row wherever `samplers` puts them):
  no softmax, and no copy when nothing is penalised. Typical and XTC could move the
  argmax (XTC at random); temperature 0 means "the deterministic argmax", so they are
  ignored then, and so are the other truncations, which cannot move it.
* Mirostat (1 or 2) replaces the truncation tail: penalties, DRY and logit bias still
  apply, then plain temperature, then mirostat's own truncation. (llama.cpp's common
  chain also drops penalties and DRY under mirostat; we keep them, as older llama.cpp
  did: they are what a user asking for them means.)
* Speed: the default chain never sorts or softmaxes the whole vocabulary. Top-k first
  finds a threshold from block maxima (one O(V) pass), keeps the few logits above it,
  and partitions those, so a 262k row costs a few passes of numpy, not a sort. Without
  top-k, top-p sorts only the tokens up to where a histogram of the mass crosses p,
  mirostat v2 thresholds the logits, and whole-row exponentials run in float32.

Where this differs from llama.cpp on purpose: logit bias runs after penalties (llama.cpp
runs it first); `repeat_last_n`/`dry_penalty_last_n` = -1 mean the whole history; DRY's
sequence breakers are matched against the token text the engine supplies (`TokenText`).

Speculation: `distribution()` is the exact final distribution `sample()` draws from; it
consumes no randomness except XTC's coin (when XTC is on). `commit()` updates mirostat's
mu for a token chosen outside, `snapshot()`/`restore()` cover the RNG and mu.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Sequence

import numpy as np

from .errors import BadRequestError

DEFAULT_SAMPLERS = ("penalties", "dry", "logit_bias", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_ALIASES = {"typical_p": "typ_p", "typical": "typ_p", "typ": "typ_p", "nucleus": "top_p", "temp": "temperature"}
_STAGES = frozenset(DEFAULT_SAMPLERS)
_ARGMAX_CHANGING = ("penalties", "dry", "logit_bias")
DRY_BREAKERS = ("\n", ":", '"', "*")
_MIROSTAT_M = 100  # llama.cpp's fixed Zipf-estimate window for mirostat v1
_DRY_MAX_BREAKER_BYTES = 40  # llama.cpp truncates longer breakers
_DRY_MAX_TAIL_TOKENS = 20


@dataclass
class SamplingParams:
    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    min_keep: int = 0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_BREAKERS))
    samplers: list[str] | None = None
    n_probs: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _INT_FIELDS and v is not None:
                if isinstance(v, float) and v.is_integer():
                    setattr(self, f.name, int(v))  # JSON clients send 40.0
                elif not isinstance(v, int) or isinstance(v, bool):
                    raise BadRequestError(f"{f.name} must be an integer, got {v!r}")
            elif f.name in _FLOAT_FIELDS:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise BadRequestError(f"{f.name} must be a number, got {v!r}")
                if not math.isfinite(v):
                    raise BadRequestError(f"{f.name} must be a finite number, got {v!r}")
        for name, ok, want in _RANGES:
            if not ok(getattr(self, name)):
                raise BadRequestError(f"{name} must be {want}, got {getattr(self, name)!r}")
        self.logit_bias = _check_logit_bias(self.logit_bias)
        breakers = self.dry_sequence_breakers
        if not isinstance(breakers, (list, tuple)) or not all(isinstance(b, str) for b in breakers):
            raise BadRequestError(f"dry_sequence_breakers must be a list of strings, got {breakers!r}")
        _ = self.order  # validates `samplers` now, not at the first token

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 and self.mirostat == 0

    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    @property
    def dry_on(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_base >= 1.0 and self.dry_penalty_last_n != 0

    @property
    def order(self) -> tuple[str, ...]:
        """The resolved stage order: canonical names, logit_bias placed."""
        if self.samplers is None:
            return DEFAULT_SAMPLERS
        names = self.samplers.split(";") if isinstance(self.samplers, str) else self.samplers
        if not isinstance(names, (list, tuple)):
            raise BadRequestError(f"samplers must be a list of names, got {self.samplers!r}")
        out: list[str] = []
        for raw in names:
            if not isinstance(raw, str):
                raise BadRequestError(f"samplers must be a list of names, got {raw!r}")
            name = raw.strip().lower().replace("-", "_")
            name = _ALIASES.get(name, name)
            if name not in _STAGES:
                raise BadRequestError(f"samplers: unknown sampler {raw!r}; known: {', '.join(DEFAULT_SAMPLERS)}")
            out.append(name)
        if "logit_bias" not in out:
            at = next((i for i, s in enumerate(out) if s not in ("penalties", "dry")), len(out))
            out.insert(at, "logit_bias")
        return tuple(out)


_INT_FIELDS = frozenset(
    {"top_k", "min_keep", "repeat_last_n", "mirostat", "dry_allowed_length", "dry_penalty_last_n", "n_probs", "seed"}
)
_RANGES = (  # (field, valid, what valid means), checked after the type checks
    ("temperature", lambda v: v >= 0, ">= 0 (0 = greedy)"),
    ("dynatemp_range", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("dynatemp_exponent", lambda v: v >= 0, ">= 0"),
    ("top_k", lambda v: v >= -1, "0 or -1 (off) or a positive count"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("typical_p", lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
    ("xtc_probability", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("xtc_threshold", lambda v: 0 <= v <= 1, "in [0, 1] (above 0.5 = off)"),
    ("min_keep", lambda v: v >= 0, ">= 0"),
    ("repeat_penalty", lambda v: v > 0, "> 0 (1 = off)"),
    ("repeat_last_n", lambda v: v >= -1, "-1 (whole context), 0 (off) or a count"),
    ("mirostat", lambda v: v in (0, 1, 2), "0 (off), 1 or 2"),
    ("mirostat_tau", lambda v: v >= 0, ">= 0"),
    ("mirostat_eta", lambda v: v >= 0, ">= 0"),
    ("dry_multiplier", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("dry_base", lambda v: v >= 0, ">= 0 (below 1 = off)"),
    ("dry_allowed_length", lambda v: v >= 0, ">= 0"),
    ("dry_penalty_last_n", lambda v: v >= -1, "-1 (whole context), 0 (off) or a count"),
    ("n_probs", lambda v: v >= 0, ">= 0"),
    ("seed", lambda v: v is None or v >= -1, "an integer >= 0, or -1 / None for a random one"),
)
_FLOAT_FIELDS = frozenset(
    {"temperature", "dynatemp_range", "dynatemp_exponent", "top_p", "min_p", "typical_p", "xtc_probability",
     "xtc_threshold", "repeat_penalty", "presence_penalty", "frequency_penalty", "mirostat_tau", "mirostat_eta",
     "dry_multiplier", "dry_base"}
)


def _check_logit_bias(bias) -> dict[int, float]:
    """A dict {id: bias} or llama-server's [[id, bias], ...]; `false` means -inf (never)."""
    items = bias.items() if isinstance(bias, dict) else bias
    out: dict[int, float] = {}
    try:
        for tok, b in items:
            if isinstance(tok, str) and tok.isdigit():
                tok = int(tok)  # JSON object keys arrive as strings
            if isinstance(tok, np.integer):
                tok = int(tok)
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise BadRequestError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            b = -math.inf if b is False else b
            if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b) or b == math.inf:
                raise BadRequestError(f"logit_bias for token {tok} must be a number (or false = never), got {b!r}")
            out[tok] = out.get(tok, 0.0) + float(b)
    except (TypeError, ValueError):
        raise BadRequestError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    return out


# -- candidates ----------------------------------------------------------------------


class _Cands:
    """The live candidate set: token ids (None = the whole vocabulary, id == index), their
    logits, and whether they are sorted by descending logit. The backend's row is never
    written: `own()` copies before the first in-place change."""

    __slots__ = ("ids", "logits", "sorted", "owned")

    def __init__(self, row: np.ndarray) -> None:
        self.ids: np.ndarray | None = None
        self.logits = row
        self.sorted = False
        self.owned = False

    @property
    def size(self) -> int:
        return self.logits.shape[0]

    def id_array(self) -> np.ndarray:
        return np.arange(self.size) if self.ids is None else self.ids

    def own(self) -> None:
        if not self.owned:
            self.logits = np.array(self.logits, dtype=np.float32, copy=True)
            self.owned = True

    def keep(self, idx: np.ndarray, is_sorted: bool) -> None:
        """Keep positions idx (an index array or a mask), in that order."""
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        self.ids = idx if self.ids is None else self.ids[idx]
        self.logits = self.logits[idx]
        self.owned = True
        self.sorted = is_sorted

    def sort(self) -> None:
        if not self.sorted:
            self.keep(np.argsort(-self.logits, kind="stable"), True)

    def top(self, k: int) -> None:
        """Keep the k largest logits, sorted descending."""
        if k < self.size:
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
        pos, sel = self.positions(tokens)
        if pos.size:
            self.own()
            self.logits[pos] += deltas[sel].astype(np.float32)
            self.sorted = False


def _top_indices(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, unordered, in O(V) without a full argpartition.

    Split the row into 4k blocks: the block maxima are 4k distinct elements, so the k-th
    largest of them is a lower bound on the row's k-th largest. Only the elements at or
    above it (k plus a few on typical rows: 43-47 for k=40 on 262k) need partitioning."""
    n = logits.shape[0]
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    blocks = 4 * k
    if n >= 8 * blocks:
        width = n // blocks
        maxima = logits[: width * blocks].reshape(blocks, width).max(axis=1)
        bound = np.partition(maxima, blocks - k)[blocks - k]
        cand = np.flatnonzero(logits >= bound)
    else:
        cand = np.arange(n)
    if cand.size > k:
        vals = logits[cand]
        cand = cand[np.argpartition(vals, cand.size - k)[cand.size - k :]]
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


def apply_penalties(c: _Cands, history: Sequence[int], p: SamplingParams) -> None:
    """llama.cpp semantics over the last repeat_last_n tokens: repetition divides a
    positive logit and multiplies a non-positive one; presence subtracts once per seen
    token, frequency once per occurrence."""
    if not p.penalizes:
        return
    window = history if p.repeat_last_n == -1 else history[-p.repeat_last_n :]
    if len(window) == 0:
        return
    toks, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    pos, sel = c.positions(toks)
    if not pos.size:
        return
    c.own()
    vals = c.logits[pos]
    if p.repeat_penalty != 1.0:
        vals = np.where(vals <= 0, vals * p.repeat_penalty, vals / p.repeat_penalty)
    c.logits[pos] = vals - counts[sel] * p.frequency_penalty - p.presence_penalty
    c.sorted = False


def apply_logit_bias(c: _Cands, bias: dict[int, float]) -> None:
    if bias:
        c.add(np.fromiter(bias.keys(), np.int64, len(bias)), np.fromiter(bias.values(), np.float64, len(bias)))


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
    n = max(int(np.searchsorted(cum, p, side="left")) + 1, min_keep)
    if n < c.size:
        c.keep(np.arange(n), True)


def min_p(c: _Cands, p: float, min_keep: int) -> None:
    """Keep tokens with probability >= p times the top one's: logit >= max + ln p."""
    if p <= 0.0 or c.size <= 1:
        return
    keep = c.logits >= c.logits.max() + math.log(p)
    if np.count_nonzero(keep) >= max(min_keep, 1):
        if not keep.all():
            c.keep(keep, c.sorted)
    else:
        c.sort()
        c.keep(np.arange(min(min_keep, c.size)), True)


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
        c.keep(np.arange(drop, c.size), True)


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
        t = lo + (hi - lo) * (entropy / math.log(c.size)) ** exponent
    if t <= 0:  # only the argmax survives
        c.keep(np.array([int(np.argmax(c.logits))]), True)
    elif t != 1.0:
        c.logits = c.logits / np.float32(t)
        c.owned = True


def mirostat_v1(c: _Cands, mu: float, n_vocab: int) -> None:
    """Top-k with k from a Zipf exponent fitted on the top m=100 tokens, chosen so the
    expected surprise is mu. The fit uses only ratios of probabilities, i.e. logit
    differences, so no softmax is needed to find k."""
    m = min(_MIROSTAT_M, c.size)
    if m < 2:
        return
    head = _top_indices(c.logits, m)
    top = np.sort(np.asarray(c.logits[head], dtype=np.float64))[::-1]
    i = np.arange(m - 1, dtype=np.float64)
    t = np.log((i + 2) / (i + 1))
    b = top[:-1] - top[1:]  # ln(p_i / p_i+1)
    with np.errstate(all="ignore"):
        s_hat = float(np.sum(t * b) / np.sum(t * t))
        eps = s_hat - 1
        k = ((eps * 2.0**mu) / (1 - float(n_vocab) ** -eps)) ** (1 / s_hat)
    k = max(int(k), 1) if math.isfinite(k) else 1  # llama.cpp: int(nan) ends at 1 too
    if k < c.size:
        c.top(k)


def mirostat_v2(c: _Cands, mu: float) -> None:
    """Keep the tokens whose surprise -log2 p is at most mu (at least the top one):
    log p = logit - logsumexp >= -mu ln 2, a test on the logits themselves."""
    x = np.asarray(c.logits, dtype=np.float32)
    keep = x >= _logsumexp(x) - mu * math.log(2)
    if not keep.any():
        keep = x == x.max()
    c.keep(keep, c.sorted)


# -- DRY ("don't repeat yourself") ----------------------------------------------------


class DryBreakers:
    """Sequence breakers resolved to token ids. `tails[head]` lists the token sequences
    that must follow `head` to complete a breaker; () means `head` alone holds one (a
    single-token breaker, which DRY never penalises)."""

    def __init__(self, tails: dict[int, tuple[tuple[int, ...], ...]]) -> None:
        self.tails = tails
        # id-indexed masks: membership tests stay O(window) however many breaker tokens
        size = max(tails, default=-1) + 1
        self._head = np.zeros(size, dtype=bool)
        self._head[list(tails)] = True
        self._single = np.zeros(size, dtype=bool)
        self._single[[t for t, ts in tails.items() if () in ts]] = True

    def is_head(self, tokens: np.ndarray) -> np.ndarray:
        return _lookup(self._head, tokens)

    def is_single(self, tokens: np.ndarray) -> np.ndarray:
        return _lookup(self._single, tokens)


def _lookup(mask: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    inside = (tokens >= 0) & (tokens < mask.size)
    out = np.zeros(tokens.shape, dtype=bool)
    out[inside] = mask[tokens[inside]]
    return out


class TokenText:
    """A model's token pieces as bytes, for matching DRY's string breakers to token ids.

    Build one per model and share it (resolving breakers scans the whole vocabulary
    once; the result is cached here per breaker list). `piece` is a list of pieces or a
    function id -> bytes/str; `tokenize` (str -> ids, no specials) is needed only for
    breakers that a token can start but not hold whole (multi-character breakers)."""

    def __init__(
        self,
        piece: Sequence[bytes | str] | Callable[[int], bytes | str],
        n_vocab: int | None = None,
        tokenize: Callable[[str], Sequence[int]] | None = None,
    ) -> None:
        self._piece = piece
        self._pieces: list[bytes] | None = None
        self.n_vocab = n_vocab
        self.tokenize = tokenize
        self._cache: dict[tuple[str, ...], DryBreakers] = {}

    @classmethod
    def from_backend(cls, backend) -> "TokenText":
        """Pieces from `backend.token_bytes` (control tokens read as empty, where
        llama.cpp's DRY would see their text), tokenization without specials."""
        return cls(
            backend.token_bytes,
            backend.info.n_vocab,
            lambda text: backend.tokenize(text, add_special=False, parse_special=False),
        )

    def pieces(self, n_vocab: int | None = None) -> list[bytes]:
        if self._pieces is None:
            src = self._piece
            if callable(src):
                n = self.n_vocab or n_vocab
                if n is None:
                    raise ValueError("TokenText needs n_vocab to enumerate a piece function")
                src = [src(i) for i in range(n)]
            self._pieces = [p.encode("utf-8") if isinstance(p, str) else bytes(p) for p in src]
        return self._pieces

    def breakers(self, seqs: Sequence[str], n_vocab: int | None = None) -> DryBreakers:
        key = tuple(seqs)
        if key not in self._cache:
            self._cache[key] = _resolve_breakers(self.pieces(n_vocab), key, self.tokenize)
        return self._cache[key]


def _resolve_breakers(pieces: list[bytes], seqs: tuple[str, ...], tokenize) -> DryBreakers:
    """llama.cpp's rule: a token holding a whole breaker is a single-token breaker; a token
    ending with a proper prefix of one is a head whose tail is the rest, tokenized.

    Searches one joined blob of all pieces with bytes.find rather than testing each of
    up to 262k pieces in Python: a match belongs to a token when it lies inside it."""
    lens = np.array([len(w) for w in pieces], dtype=np.int64)
    ends = np.cumsum(lens)
    starts = ends - lens
    blob = b"".join(pieces)
    last = np.full(len(pieces), -1, dtype=np.int16)  # each piece's last byte, -1 if empty
    nonempty = lens > 0
    last[nonempty] = np.frombuffer(blob, dtype=np.uint8)[ends[nonempty] - 1]

    def holders(pattern: bytes) -> set[int]:
        """Tokens whose piece contains `pattern` (overlapping matches included)."""
        at, i = [], blob.find(pattern)
        while i >= 0:
            at.append(i)
            i = blob.find(pattern, i + 1)
        at_a = np.array(at, dtype=np.int64)
        tok = np.searchsorted(starts, at_a, side="right") - 1  # the last token starting at or before
        return set(tok[at_a + len(pattern) <= ends[tok]].tolist())

    tails: dict[int, list[tuple[int, ...]]] = {}
    rest_ids: dict[bytes, tuple[int, ...] | None] = {}
    for seq in seqs:
        b = seq.encode("utf-8")[:_DRY_MAX_BREAKER_BYTES]
        if not b:
            continue
        whole = holders(b)
        for tok in whole:
            tails.setdefault(tok, [])
            if () not in tails[tok]:
                tails[tok].append(())
        if tokenize is None:
            continue
        for j in range(1, len(b)):
            prefix = b[:j]
            heads = {t for t in np.flatnonzero(last == prefix[-1]).tolist() if pieces[t].endswith(prefix)} - whole
            if not heads:
                continue
            rest = b[j:]
            if rest not in rest_ids:
                try:
                    rest_ids[rest] = tuple(int(t) for t in tokenize(rest.decode("utf-8")))[:_DRY_MAX_TAIL_TOKENS]
                except UnicodeDecodeError:  # the breaker split inside a character
                    rest_ids[rest] = None
            if rest_ids[rest] is not None:
                for t in heads:
                    have = tails.setdefault(t, [])
                    if rest_ids[rest] not in have:
                        have.append(rest_ids[rest])
    return DryBreakers({t: tuple(ts) for t, ts in tails.items()})


NO_BREAKERS = DryBreakers({})


def dry_penalties(window: np.ndarray, p: SamplingParams, breakers: DryBreakers) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, penalties) for the tokens that would extend a repeat of the context's
    end, following llama.cpp's DRY.

    For each earlier position q, L(q) = the length of the longest common suffix of
    window[:q+1] and the whole window, capped at `rep_limit` (the tokens since the last
    sequence breaker). The token after q, window[q+1], would make that repeat L+1 long;
    if L >= allowed_length it is penalised multiplier * base^(L - allowed_length), using
    its largest L. Single-token breakers are never penalised."""
    n = window.shape[0]
    allowed = p.dry_allowed_length
    empty = (np.empty(0, dtype=np.int64), np.empty(0))
    if n <= allowed:
        return empty
    rep_limit = _dry_rep_limit(window, breakers)
    if rep_limit < allowed:
        return empty
    # Lengths past allowed + max_exponent all get the clamped penalty: no need to
    # measure them, which bounds the work on long degenerate repeats.
    max_exp = int(88.7228391 / math.log(p.dry_base)) if p.dry_base > 1.000001 else 0
    cap = min(rep_limit, allowed + max_exp) if max_exp > 0 else rep_limit
    # Extend all candidate matches backwards together, one token per numpy step.
    q = np.flatnonzero(window[:-1] == window[-1]) if cap > 0 else np.empty(0, dtype=np.int64)
    ends, lens = [], []
    s = 1
    while q.size and s < cap:
        prev = q - s
        ok = prev >= 0
        ok[ok] = window[prev[ok]] == window[n - 1 - s]
        ends.append(q[~ok])
        lens.append(np.full(int((~ok).sum()), s))
        q = q[ok]
        s += 1
    ends.append(q)
    lens.append(np.full(q.size, s))
    ends_a, lens_a = np.concatenate(ends), np.concatenate(lens)
    if allowed == 0:  # every position counts, matched or not
        ends_a = np.concatenate([np.arange(n - 1), ends_a])
        lens_a = np.concatenate([np.zeros(n - 1, dtype=np.int64), lens_a])
    hit = lens_a >= allowed
    if not hit.any():
        return empty
    toks, inv = np.unique(window[ends_a[hit] + 1], return_inverse=True)
    best = np.zeros(toks.size, dtype=np.int64)
    np.maximum.at(best, inv, lens_a[hit])
    keep = ~breakers.is_single(toks)
    toks, best = toks[keep], best[keep]
    exp = best - allowed
    if max_exp > 0:
        exp = np.minimum(exp, max_exp)
    return toks, p.dry_multiplier * np.power(float(p.dry_base), exp.astype(np.float64))


def _dry_rep_limit(window: np.ndarray, breakers: DryBreakers) -> int:
    """Tokens after the most recent complete breaker (the whole window if none)."""
    n = window.shape[0]
    if not breakers.tails:
        return n
    for pos in np.flatnonzero(breakers.is_head(window))[::-1]:
        dist = n - 1 - int(pos)
        longest = -1
        for tail in breakers.tails[int(window[pos])]:
            if longest < len(tail) <= dist and tuple(window[pos + 1 : pos + 1 + len(tail)].tolist()) == tail:
                longest = len(tail)
        if longest >= 0:
            return dist - longest
    return n


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
            apply_penalties(c, history, p)
        elif name == "dry":
            self._dry(c, history)
        elif name == "logit_bias":
            apply_logit_bias(c, p.logit_bias)
        elif name == "top_k":
            top_k(c, p.top_k)
        elif name == "typ_p":
            typical(c, p.typical_p, p.min_keep)
        elif name == "top_p":
            top_p(c, p.top_p, p.min_keep)
        elif name == "min_p":
            min_p(c, p.min_p, p.min_keep)
        elif name == "xtc":
            xtc(c, p.xtc_probability, p.xtc_threshold, p.min_keep, self.rng)
        elif name == "temperature":
            temperature(c, p.temperature, p.dynatemp_range, p.dynatemp_exponent)

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
        toks, pens = dry_penalties(np.asarray(window, dtype=np.int64), p, self._breakers)
        if toks.size:
            c.add(toks, -pens)

    def adjusted(self, row: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The row after the argmax-changing stages (penalties, DRY, logit bias), in the
        configured order; the backend's buffer is never written."""
        self._n_row = row.shape[0]
        c = _Cands(row)
        for name in self._pre:
            self._stage(name, c, history)
        return c.logits

    def distribution(self, row: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and float64 probabilities: exactly what the draw in `sample` uses,
        after every stage (for mirostat, after its truncation with the current mu).

        Consumes no randomness except XTC's coin, and changes no other state. Small sets
        (always, in the default chain) come sorted by descending probability; a chain
        that keeps more than 4096 tokens returns them in id order."""
        p = self.params
        if p.greedy:
            return np.array([int(np.argmax(self.adjusted(row, history)))]), np.array([1.0])
        c = _Cands(row)
        n_vocab = self._n_row = row.shape[0]
        if p.mirostat:
            for name in self._pre:
                self._stage(name, c, history)
            temperature(c, p.temperature)
            if p.mirostat == 1:
                mirostat_v1(c, self.mu, n_vocab)
            else:
                mirostat_v2(c, self.mu)
        else:
            for name in self._order:
                self._stage(name, c, history)
        if not c.sorted and c.size <= 4096:
            c.sort()
        return c.id_array(), _softmax(c.logits)

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
        ids, probs = self.distribution(row, history)
        token = self.draw(ids, probs)
        self.commit(token, ids, probs)
        return token

    def candidates(self, row: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The old name of `distribution`."""
        return self.distribution(row, history)

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

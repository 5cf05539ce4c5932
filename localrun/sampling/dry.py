"""DRY ("don't repeat yourself"): the default sequence breakers, their resolution to
token ids against a model's token text (TokenText), and the penalties."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from .params import SamplingParams

DRY_BREAKERS = ("\n", ":", '"', "*")
_DRY_MAX_BREAKER_BYTES = 40  # llama.cpp truncates longer breakers
_DRY_MAX_TAIL_TOKENS = 20


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

"""DRY's sequence breakers: the defaults, and their resolution to token ids against a
model's token text (`TokenText`).

llama.cpp's rule: a token whose text holds a whole breaker is a single-token breaker; a
token whose text ends with a proper prefix of one is a head, completed by the rest of the
breaker, tokenized. Resolving it used to scan the whole vocabulary per breaker (~35 ms
on Gemma-3's 262k tokens). Now the vocabulary is indexed once per model (one byte blob;
tokens sorted by their last two bytes), so a breaker costs a few vectorised passes over
the blob plus a binary search per prefix; each breaker string is cached, and a
request's list is the union of cached singles. `TokenText` is thread-safe: a request
builder resolves a request's breakers in a worker thread, and the scheduler's Sampler
finds them cached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterator, Sequence

import numpy as np

from .declare import MAX_BREAKER_BYTES

DRY_BREAKERS = ("\n", ":", '"', "*")
_MAX_TAIL_TOKENS = 20  # llama.cpp's cap on a breaker's tokenized rest
_CACHED_BREAKERS = 256  # single breakers kept per model (one may hold ~100k token ids)
_CACHED_LISTS = 64  # resolved lists kept per model

Tails = dict[int, tuple[tuple[int, ...], ...]]  # head token -> the token sequences that complete it


class DryBreakers:
    """Sequence breakers resolved to token ids: `single` tokens hold a whole breaker
    (DRY never penalises them); a head token needs one of its tails after it. `tails` is
    one mapping per breaker, kept apart so a union of cached breakers costs no merging."""

    def __init__(self, single: Sequence[int], tails: Sequence[Tails] = ()) -> None:
        single = np.asarray(single, dtype=np.int64)
        self._tails = [t for t in tails if t]
        heads = np.concatenate([np.fromiter(t, np.int64, len(t)) for t in self._tails] or [np.empty(0, np.int64)])
        self.empty = not single.size and not heads.size
        # id-indexed masks: membership tests stay O(window) however many breaker tokens
        size = int(max(single.max(initial=-1), heads.max(initial=-1))) + 1
        self._single = np.zeros(size, dtype=bool)
        self._single[single] = True
        self._head = self._single.copy()
        self._head[heads] = True

    def is_head(self, tokens: np.ndarray) -> np.ndarray:
        """Tokens that hold a breaker or may begin one."""
        return _lookup(self._head, tokens)

    def is_single(self, tokens: np.ndarray) -> np.ndarray:
        return _lookup(self._single, tokens)

    def tails_of(self, token: int) -> Iterator[tuple[int, ...]]:
        for t in self._tails:
            yield from t.get(token, ())

    @property
    def tails(self) -> dict[int, set[tuple[int, ...]]]:
        """Every head with its tails, merged (for reading; the DRY stage uses `tails_of`)."""
        out: dict[int, set[tuple[int, ...]]] = {}
        for t in self._tails:
            for head, ts in t.items():
                out.setdefault(head, set()).update(ts)
        return out


def _lookup(mask: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    inside = (tokens >= 0) & (tokens < mask.size)
    out = np.zeros(tokens.shape, dtype=bool)
    out[inside] = mask[tokens[inside]]
    return out


NO_BREAKERS = DryBreakers(())


class _VocabIndex:
    """A vocabulary's pieces as one byte blob (token t is blob[starts[t]:ends[t]]) and its
    tokens sorted by (last byte, the byte before it), so 'which tokens hold this text' is
    a few numpy passes and 'which end with this text' a binary search and a short filter,
    not a Python loop over every piece."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.lens = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        self.ends = np.cumsum(self.lens)
        self.starts = self.ends - self.lens
        self.blob = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        last = np.full(len(pieces), 256, dtype=np.int64)  # 256: no such byte (a short piece)
        before = np.full(len(pieces), 256, dtype=np.int64)
        has1, has2 = self.lens >= 1, self.lens >= 2
        last[has1] = self.blob[self.ends[has1] - 1]
        before[has2] = self.blob[self.ends[has2] - 2]
        key = last * 257 + before
        self._order = np.argsort(key, kind="stable")
        self._keys = key[self._order]

    def holders(self, pattern: bytes) -> np.ndarray:
        """Tokens whose piece contains `pattern` (every occurrence counts, overlapping
        ones too), sorted."""
        blob, m = self.blob, len(pattern)
        if blob.size < m:
            return np.empty(0, dtype=np.int64)
        hit = blob[: blob.size - m + 1] == pattern[0]
        if m > 1:  # two bytes at once: far fewer places to follow up than a common first byte
            hit &= blob[1 : blob.size - m + 2] == pattern[1]
        at = np.flatnonzero(hit)
        for k in range(2, m):
            at = at[blob[at + k] == pattern[k]]
            if not at.size:
                break
        tok = np.searchsorted(self.starts, at, side="right") - 1  # the last token starting at or before
        return np.unique(tok[at + m <= self.ends[tok]])

    def starting_with(self, prefix: bytes) -> np.ndarray:
        """Tokens whose piece begins with `prefix` (non-empty), sorted."""
        tok = np.flatnonzero(self.lens >= len(prefix))
        for k, byte in enumerate(prefix):
            tok = tok[self.blob[self.starts[tok] + k] == byte]
            if not tok.size:
                break
        return tok

    def writing(self, text: bytes) -> np.ndarray:
        """Tokens whose piece begins with `text` (non-empty), or is a non-empty beginning
        of it, sorted: the tokens that may write `text` next. One narrowing pass."""
        tok = np.flatnonzero(self.lens > 0)
        found = []
        for k, byte in enumerate(text):
            if k:  # what matched text[:k] and ends there is a beginning of it
                ends = self.lens[tok] == k
                found.append(tok[ends])
                tok = tok[~ends]
            tok = tok[self.blob[self.starts[tok] + k] == byte]
            if not tok.size:
                break
        return np.sort(np.concatenate(found + [tok]))

    def ending_with(self, suffix: bytes) -> np.ndarray:
        """Tokens whose piece ends with `suffix`."""
        lo = suffix[-1] * 257 + (suffix[-2] if len(suffix) > 1 else 0)
        hi = suffix[-1] * 257 + (suffix[-2] + 1 if len(suffix) > 1 else 257)
        cand = self._order[np.searchsorted(self._keys, lo) : np.searchsorted(self._keys, hi)]
        for k in range(3, len(suffix) + 1):
            cand = cand[self.lens[cand] >= k]
            cand = cand[self.blob[self.ends[cand] - k] == suffix[-k]]
        return cand


class _Resolved:
    """One breaker's tokens: the single-token holders and each head's tails."""

    __slots__ = ("single", "tails")

    def __init__(self, single: np.ndarray, tails: Tails) -> None:
        self.single, self.tails = single, tails


def _resolve(index: _VocabIndex, breaker: str, tokenize) -> _Resolved:
    # llama.cpp truncates a breaker at 40 bytes; SamplingParams refuses longer ones, and
    # this bounds the work for any other caller
    b = breaker.encode("utf-8")[:MAX_BREAKER_BYTES]
    if not b:
        return _Resolved(np.empty(0, dtype=np.int64), {})
    single = index.holders(b)
    tails: dict[int, list[tuple[int, ...]]] = {}
    complete = [single]  # plus heads whose rest tokenizes to nothing: they end the breaker alone
    if tokenize is not None:
        for j in range(1, len(b)):
            heads = index.ending_with(b[:j])
            heads = heads[~np.isin(heads, single)]
            if not heads.size:
                continue
            try:
                rest = tuple(int(t) for t in tokenize(b[j:].decode("utf-8")))[:_MAX_TAIL_TOKENS]
            except UnicodeDecodeError:  # the breaker split inside a character
                continue
            if not rest:
                complete.append(heads)
            for t in heads.tolist():
                tails.setdefault(t, []).append(rest)
    return _Resolved(np.unique(np.concatenate(complete)), {t: tuple(ts) for t, ts in tails.items()})


def _union(parts: list[_Resolved]) -> DryBreakers:
    single = np.concatenate([p.single for p in parts]) if parts else np.empty(0, dtype=np.int64)
    return DryBreakers(single, [p.tails for p in parts])


class TokenText:
    """A model's token pieces as bytes, for matching DRY's string breakers to token ids.

    Build one per model and share it: the vocabulary is read and indexed once, each
    breaker string is resolved once (up to 256 kept), and each list once (up to 64 kept).
    `piece` is a list of pieces or a function id -> bytes/str; `tokenize` (str -> ids, no
    specials) is needed only for breakers that a token can start but not hold whole
    (multi-character breakers). Safe to share between threads."""

    def __init__(
        self,
        piece: Sequence[bytes | str] | Callable[[int], bytes | str],
        n_vocab: int | None = None,
        tokenize: Callable[[str], Sequence[int]] | None = None,
    ) -> None:
        self._piece = piece
        self._pieces: list[bytes] | None = None
        self._index: _VocabIndex | None = None
        self.n_vocab = n_vocab
        self.tokenize = tokenize
        self._build = threading.Lock()  # held while the vocabulary is read and indexed, once
        self._cache = threading.Lock()  # held only to read or update the caches below
        self._one: OrderedDict[str, _Resolved] = OrderedDict()
        self._lists: OrderedDict[tuple[str, ...], DryBreakers] = OrderedDict()

    @classmethod
    def from_backend(cls, backend) -> "TokenText":
        """Pieces from `backend.token_bytes` (control tokens read as empty, where
        llama.cpp's DRY would see their text), tokenization without specials."""
        return cls(
            backend.token_bytes,
            backend.info.n_vocab,
            lambda text: backend.tokenize(text, add_special=False, parse_special=False),
        )

    def piece(self, token: int) -> bytes:
        """One token's bytes, without reading the whole vocabulary."""
        if self._pieces is not None:
            return self._pieces[token]
        p = self._piece[token] if not callable(self._piece) else self._piece(token)
        return p.encode("utf-8") if isinstance(p, str) else bytes(p)

    def pieces(self, n_vocab: int | None = None) -> list[bytes]:
        with self._build:
            if self._pieces is None:
                src = self._piece
                if callable(src):
                    n = self.n_vocab or n_vocab
                    if n is None:
                        raise ValueError("TokenText needs n_vocab to enumerate a piece function")
                    src = [src(i) for i in range(n)]
                self._pieces = [p.encode("utf-8") if isinstance(p, str) else bytes(p) for p in src]
            return self._pieces

    def index(self, n_vocab: int | None = None) -> _VocabIndex:
        """The vocabulary's index, built on first use (~0.2 s on 262k tokens)."""
        pieces = self.pieces(n_vocab)
        with self._build:
            if self._index is None:
                self._index = _VocabIndex(pieces)
            return self._index

    def breakers(self, seqs: Sequence[str], n_vocab: int | None = None) -> DryBreakers:
        """The breakers `seqs` resolved against this vocabulary (cached per list and per
        breaker; call it ahead, off the scheduler thread, to warm the caches)."""
        key = tuple(seqs)
        hit = self._get(self._lists, key)
        if hit is not None:
            return hit
        index = self.index(n_vocab)
        parts = []
        for s in dict.fromkeys(key):
            one = self._get(self._one, s)
            if one is None:
                one = _resolve(index, s, self.tokenize)  # outside the locks: pure, and idempotent
                self._put(self._one, s, one, _CACHED_BREAKERS)
            parts.append(one)
        out = _union(parts)
        self._put(self._lists, key, out, _CACHED_LISTS)
        return out

    def _get(self, cache: OrderedDict, key):
        with self._cache:
            hit = cache.get(key)
            if hit is not None:
                cache.move_to_end(key)
            return hit

    def _put(self, cache: OrderedDict, key, value, most: int) -> None:
        with self._cache:
            cache[key] = value
            cache.move_to_end(key)
            while len(cache) > most:
                cache.popitem(last=False)

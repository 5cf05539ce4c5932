"""`GrammarMatcher`: one generation's position in a compiled `Grammar`.

It lives apart from `core` because it is per-generation state that the engine drives at
every decode step (masks, accepting tokens, speculation's rollback), while `core` makes,
validates and compiles grammars once per request.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import BadRequestError
from .core import Grammar, _budget_hint, _first_line, _need_llg


class GrammarMatcher:
    """One generation's position in a grammar.

    The engine, per step: `row = m.apply(row)` (or `m.allowed_mask()`), sample,
    `m.accept(token)`; finish when the token is a stop id or `m.is_done()`. EOS
    ids are allowed exactly where the grammar accepts. Speculation: `count_valid(draft)`
    says how much of a draft the grammar allows, `draft_masks(draft)` gives the mask
    of every verify row, and `rollback(n)` / `snapshot()` + `restore()` undo tokens.

    Making one copies the grammar's compiled start state and its first mask (~0.1 ms;
    `Grammar.compile`, which `request.prepare` runs off the scheduler thread). Without it,
    the first matcher of a grammar compiles it, blocking the caller for up to the
    LEXER_FUEL budget (~0.25 s worst measured; most grammars take 1-10 ms).
    """

    def __init__(self, grammar: Grammar, tokenizer) -> None:
        _need_llg()
        self.n_vocab = int(tokenizer.vocab_size)
        start, mask = grammar._start_state(tokenizer)
        if start.is_error():  # e.g. a `<|name|>` this vocabulary has no token for
            err = start.get_error()
            raise BadRequestError(f"the grammar does not compile for this model: {_first_line(err)}{_budget_hint(err)}")
        self._m = start.deep_copy()
        self._words = np.empty((1, (self.n_vocab + 31) // 32), np.int32)
        self._mask: np.ndarray | None = mask  # cached for the current state (the start's, read-only, shared)

    def allowed_mask(self) -> np.ndarray:
        """Bool array [n_vocab]: True where the token may come next. Do not modify it."""
        if self._mask is None:
            self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            # one bit per token, little-endian within each int32 word
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little", count=self.n_vocab)
            self._mask = bits.view(np.bool_)
        return self._mask

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A new float32 row equal to `logits` where allowed and -inf elsewhere (the
        backend's row is a view into its buffer, so it is not written)."""
        allowed = self.allowed_mask()
        idx = np.flatnonzero(allowed)
        if 2 * idx.size > self.n_vocab:  # free text: a dense select beats a big gather
            return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)
        # most masks are sparse (JSON punctuation, digits): copy just the allowed entries
        out = np.full(self.n_vocab, -np.inf, np.float32)
        out[idx] = logits[idx]
        return out

    def allows(self, token: int) -> bool:
        """Whether `token` may come next, without a full mask (~1 us): lets the engine
        sample unconstrained first and mask only when the draw is rejected."""
        return self._m.validate_tokens([int(token)]) == 1

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise ValueError(f"token {token} is not allowed by the grammar: {self._m.get_error()}")
        self._mask = None

    def count_valid(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the grammar allows; the state is unchanged."""
        return self._m.validate_tokens([int(t) for t in tokens])

    def draft_masks(self, draft: Sequence[int]) -> np.ndarray:
        """Bool [len(draft)+1, n_vocab]: the mask before each draft token and after the
        last. Rows past the first disallowed draft token repeat its mask (a verifier stops there)."""
        out = np.empty((len(draft) + 1, self.n_vocab), np.bool_)
        done = 0
        for i in range(len(draft) + 1):
            out[i] = self.allowed_mask()
            if i == len(draft) or not self._m.validate_tokens([int(draft[i])]):
                out[i + 1:] = out[i]
                break
            self.accept(draft[i])
            done += 1
        self.rollback(done)
        return out

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens. (An EOS accepted after `is_done()` moved
        nothing and does not count; the generation has ended there anyway.)"""
        if n and not self._m.rollback(int(n)):
            raise ValueError(f"cannot roll back {n} tokens: {self._m.get_error()}")
        self._mask = None

    def snapshot(self) -> Any:
        """An opaque copy of the state (a ~2 us deep copy in llguidance)."""
        return self._m.deep_copy()

    def restore(self, snap: Any) -> None:
        self._m = snap.deep_copy()  # copy again: one snapshot may be restored twice
        self._mask = None

    def reset(self) -> None:
        self._m.reset()
        self._mask = None

    def is_accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar (EOS may come)."""
        return self._m.is_accepting()

    def is_done(self) -> bool:
        """Nothing but EOS can follow (or EOS was accepted): the engine should stop."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

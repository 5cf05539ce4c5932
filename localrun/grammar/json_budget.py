"""A JSON answer that closes before `max_tokens` cuts it.

Bounded whitespace (grammar.JSON_WHITESPACE) keeps a sampled JSON answer from wandering
into blank lines, but a small model sampled hot can still loop inside an array or a string
(SmolLM2-135M at temperature 1.0: 12-13 of 100 schema answers never closed, in 120
tokens or in 400) until `max_tokens` cuts it: invalid JSON, useless to the client that parses it.

So in the last CLOSING_RESERVE tokens of a JSON-schema answer, each choice is narrowed to
the tokens the grammar allows that only close what is open (`"`, `]`, `}`, with whitespace
around them) or end the answer, whenever the grammar allows one of those; where it allows
none (a required key still missing, a string under its minLength), to the allowed tokens
of JSON punctuation alone (`,"`, `":`, `":[`: the way on to the next key, and the end of a
number); failing those, to the allowed tokens that hold no whitespace (a key's name, a
digit); and failing those, the grammar's choice as usual. No `,` is ever a closing token,
so no array or object grows while a closing token is allowed, and a string opened in the
reserve closes at the next token. The answer is then valid JSON, shorter than the model
would have written, and its finish reason stays "length" (a client can tell it was cut). Tool-call arguments are left alone: a call's JSON has its own
grammar around it, and a call cut short is refused by the client either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

# tokens at the end of an answer kept for closing it: at most one per open string, array
# or object (tokenizers join most runs of closers), with room for a required key or two;
# an answer nested deeper than that can still be cut
CLOSING_RESERVE = 16

_CLOSING = frozenset(b'"]}')
_PUNCTUATION = frozenset(b'"]},:[{')
_SPACE = frozenset(b" \t\n\r")


def budget_tokens(pieces: Sequence[bytes], end_ids: Iterable[int]) -> tuple[np.ndarray, ...]:
    """Three bool masks [n_vocab], in the order a choice prefers them: the tokens that only
    close (at least one of `"`, `]`, `}`, and nothing but whitespace beside them) or end
    an answer (`end_ids`); the tokens of JSON punctuation alone (and whitespace); and the
    tokens that hold no whitespace at all."""
    closing = np.zeros(len(pieces), np.bool_)
    punctuation = np.zeros(len(pieces), np.bool_)
    compact = np.zeros(len(pieces), np.bool_)
    for i, piece in enumerate(pieces):
        chars = set(piece)
        closing[i] = bool(chars & _CLOSING) and chars <= _CLOSING | _SPACE
        punctuation[i] = bool(chars - _SPACE) and chars <= _PUNCTUATION | _SPACE
        compact[i] = bool(chars) and not chars & _SPACE
    for i in end_ids:
        if 0 <= i < len(pieces):
            closing[i] = True
    return closing, punctuation, compact


def narrow(row: np.ndarray, allowed: np.ndarray, preferred: Sequence[np.ndarray]) -> tuple[np.ndarray, bool] | None:
    """The row restricted to the allowed tokens of the first mask in `preferred` that
    holds any, and whether that left out another allowed token; None when none does."""
    for prefer in preferred:
        keep = allowed & prefer
        if keep.any():
            out = np.full(row.shape[0], -np.inf, np.float32)
            out[keep] = row[keep]
            return out, bool((allowed & ~prefer).any())
    return None

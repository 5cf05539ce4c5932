"""A JSON answer that closes before `max_tokens` cuts it.

Bounded whitespace (grammar.JSON_WHITESPACE) keeps a sampled JSON answer from wandering
into blank lines, but a small model sampled hot can still loop inside an array or a string
(SmolLM2-135M at temperature 1.0: 12-13 of 100 schema answers never closed, in 120
tokens or in 400) until `max_tokens` cuts it: invalid JSON, useless to the client that parses it.

So in the last CLOSING_RESERVE tokens of a JSON-schema answer, each choice is narrowed
whenever the grammar allows a token of the first kind below that it allows at all. Inside
a string (the answer so far holds an odd number of unescaped quotes): a token that ends
it (`"`, then only `]`, `}` or whitespace), else one without whitespace (a string under
its minLength). Outside: a token that only closes (`]`, `}`, whitespace) or ends the
answer; else one of JSON punctuation alone (`,"`, `":`, `":[`: the way on to a required
key still missing, and the end of a number), unpadded before padded (` ,` then ` "` spend
two tokens of the reserve where `,"` spends one); else one without whitespace (a key's name, a
digit). Failing all, the grammar's choice as usual. No `,` ever closes, so no array or
object grows while a closing token is allowed, and a string opened in the reserve ends at
the next token. The answer is then valid JSON, shorter than the model
would have written, and its finish reason stays "length" (a client can tell it was cut). Tool-call arguments are left alone: a call's JSON has its own
grammar around it, and a call cut short is refused by the client either way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# tokens at the end of an answer kept for closing it: at most one per open string, array
# or object (tokenizers join most runs of closers), with room for a required key or two;
# an answer nested deeper than that can still be cut
CLOSING_RESERVE = 16

_CLOSERS = frozenset(b"]}")
_ESCAPED = re.compile(rb"\\.", re.S)
_PUNCTUATION = frozenset(b'"]},:[{')
_SPACE = frozenset(b" \t\n\r")


@dataclass(frozen=True)
class BudgetTokens:
    """Bool masks [n_vocab] of one vocabulary's tokens, by what they do in a JSON answer."""

    ends_string: np.ndarray  # `"` first, then only `]`, `}` or whitespace
    closing: np.ndarray  # only `]`, `}` and whitespace, at least one of the two; and the end ids
    punctuation: np.ndarray  # JSON punctuation and whitespace only
    compact: np.ndarray  # no whitespace at all
    tight_punctuation: np.ndarray  # JSON punctuation without whitespace (`,"` before ` ,`)

    def preferred(self, inside_string: bool) -> tuple[np.ndarray, ...]:
        """The masks a choice tries in order, inside a string or outside."""
        if inside_string:
            return self.ends_string, self.compact
        return self.closing, self.tight_punctuation, self.punctuation, self.compact


def budget_tokens(pieces: Sequence[bytes], end_ids: Iterable[int]) -> BudgetTokens:
    """The vocabulary `pieces` sorted for json_budget (`end_ids`: the ids that end an answer)."""
    n = len(pieces)
    ends_string, closing, punctuation, compact = (np.zeros(n, np.bool_) for _ in range(4))
    for i, piece in enumerate(pieces):
        chars = set(piece)
        ends_string[i] = piece[:1] == b'"' and set(piece[1:]) <= _CLOSERS | _SPACE
        closing[i] = bool(chars & _CLOSERS) and chars <= _CLOSERS | _SPACE
        punctuation[i] = bool(chars - _SPACE) and chars <= _PUNCTUATION | _SPACE
        compact[i] = bool(chars) and not chars & _SPACE
    for i in end_ids:
        if 0 <= i < n:
            closing[i] = True
    return BudgetTokens(ends_string, closing, punctuation, compact, punctuation & compact)


def inside_string(text: bytes) -> bool:
    """Whether JSON text so far stops inside a string: an odd number of quotes once every
    escaped character (`\\"` among them) is taken out."""
    return _ESCAPED.sub(b"", text).count(b'"') % 2 == 1


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

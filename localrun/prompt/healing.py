"""Token healing: a prompt that ends inside the text the model writes (a fill-in-the-middle
prompt ends at the editor's cursor) may end on a token the model would not have chosen
there: a line ending "def " ends on a lone space, "math.sq" on ".s" "q" where the
vocabulary has ".sqrt". The prompt is backed up over such tokens (`heal_back`) and the
answer's first tokens must write their text again (`healing_row`); the answer's text
does not repeat it (Engine._accept). GenerationRequest.token_healing asks for it.

`backend` is a localrun.backends.base.Backend; `index` its vocabulary's
localrun.sampling.breakers._VocabIndex (TokenText.index).
"""

from __future__ import annotations

import numpy as np

# a prompt is backed up at most this many tokens (each is written again before the
# answer's first character: a decode step)
HEAL_MOST = 3


def heal_back(backend, index, tokens: list[int]) -> tuple[list[int], bytes]:
    """How far to back the prompt's end up: (the prompt left, the text taken off). The
    last token goes if it is text; the one before it too while some token of the
    vocabulary begins with, and is longer than, the text taken off so far with it (the
    tokenizer split what the model may write as one token); at most HEAL_MOST tokens,
    the first never."""
    cut, text = len(tokens), b""
    while cut > 1 and len(tokens) - cut < HEAL_MOST:
        token = tokens[cut - 1]
        piece = backend.token_bytes(token)
        if not piece or backend.is_control(token):
            break
        longer = piece + text
        if text and not (index.lens[index.starting_with(longer)] > len(longer)).any():
            break
        cut, text = cut - 1, longer
    return tokens[:cut], text


def healing_row(index, text: bytes, row: np.ndarray) -> np.ndarray:
    """`row` with only the tokens that write `text` again: those beginning with it, and
    those it begins with (the rest follows in the next steps)."""
    allowed = index.writing(text)
    allowed = allowed[allowed < row.shape[0]]
    out = np.full(row.shape[0], -np.inf, np.float32)
    out[allowed] = row[allowed]
    return out

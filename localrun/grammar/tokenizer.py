"""A model's vocabulary as llguidance reads it: `build_tokenizer`, cached per backend.

llguidance needs only each token's bytes, so the tokenizer is built from the backend seam
(`token_bytes`, `is_control`) and is the same for llama.cpp and MLX. It lives apart from
`core` because it depends on a loaded model, while a `Grammar` is tokenizer-free and made
(and validated) before any model work. The byte vocabulary that validation probes with
stays in `core`, next to the one function that uses it.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..errors import BadRequestError
from .core import _need_llg

# backend -> (special_names key, tokenizer); weak, so a dropped backend frees its entry
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, tuple[dict, Any]]" = weakref.WeakKeyDictionary()


class _Vocab:
    """The duck type `llguidance.TokenizerWrapper` reads. It holds the backend weakly:
    the cache maps backend -> tokenizer -> this, and a strong link would pin the backend."""

    def __init__(self, backend, tokens: list[bytes], specials: list[int], eos: int, bos: int | None) -> None:
        self._backend = weakref.ref(backend)
        self.tokens = tokens
        self.special_token_ids = specials
        self.eos_token_id = eos
        self.bos_token_id = bos

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance tokenizes a few strings (a probe, a grammar's forced prefix), as bytes
        backend = self._backend()
        if backend is None:
            return []
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return backend.tokenize(text, add_special=False, parse_special=False)


def build_tokenizer(backend, special_names: dict[int, str] | None = None):
    """An `llguidance.LLTokenizer` for the backend's vocabulary, cached per backend.

    Control tokens (and any token with no bytes) become llguidance "special" tokens: they
    never match grammar text, only an explicit reference such as `<|im_end|>` or
    `<[2]>` in a Lark grammar. Named references need `special_names` ({id: text}); when
    it is None the backend's optional `token_text(id)` supplies them, else only `<[id]>`
    works. EOS for the grammar is every id in `info.stop_ids` (or `info.eos_id`).
    Building costs ~0.3 s on a 49k vocabulary and 2-3 s on Gemma's 262k (2 busy cores).
    """
    llg = _need_llg()
    key = None if special_names is None else tuple(sorted(special_names.items()))
    hit = _TOKENIZERS.get(backend)
    if hit is not None and hit[0] == key:
        return hit[1]
    info = backend.info
    n = int(info.n_vocab)
    token_text = getattr(backend, "token_text", None) if special_names is None else None
    names = dict(special_names or {})
    specials: list[int] = []
    tokens: list[bytes] = []
    for t in range(n):
        piece = backend.token_bytes(t)
        # an empty non-control token would match anywhere without moving the parser:
        # make it special too, so only a grammar that names it can produce it
        if backend.is_control(t) or not piece:
            specials.append(t)
            name = names.get(t) or (token_text(t) if callable(token_text) else "")
            piece = b"\xff" + name.encode() if name else b""
        tokens.append(piece)
    eos = sorted(info.stop_ids) or ([info.eos_id] if info.eos_id is not None else [])
    if not eos:
        raise BadRequestError(f"{info.path} has no end-of-sequence token; grammars need one")
    vocab = _Vocab(backend, tokens, specials, eos[0], info.bos_id)
    tok = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=n, eos_token=eos)
    _TOKENIZERS[backend] = (key, tok)
    return tok

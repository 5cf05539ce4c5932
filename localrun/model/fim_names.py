"""Fill-in-the-middle tokens found by their text, for GGUF files whose metadata names none.

Many code models (Qwen2.5-Coder among them) carry no `tokenizer.ggml.fim_*_token_id`
keys; llama.cpp finds their FIM tokens at load time by the tokens' text. An unloaded
model's facts (what `/api/show` lists as "insert") must agree, so this reads the header's
token list the same way: the spellings below are the ones code models use.
"""

from __future__ import annotations

import struct

from localrun.model.gguf_header import open_regular

FIM_TEXTS = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
}
_GGUF_STRING = 8
_GGUF_ARRAY = 9


def fim_ids_by_name(path: str, span: tuple[int, int]) -> dict[str, int]:
    """{"prefix"|"suffix"|"middle": id} for the FIM tokens whose text the vocabulary holds.
    `span` is the [start, end) of the `tokenizer.ggml.tokens` entry in the validated
    header (the reader checked its lengths), so the walk stays inside it."""
    start, end = span
    with open_regular(path) as f:
        f.seek(start)
        entry = f.read(end - start)
    wanted = {text.encode(): part for part, texts in FIM_TEXTS.items() for text in texts}
    (key_len,) = struct.unpack_from("<Q", entry, 0)
    at = 8 + key_len
    kind, elem, count = struct.unpack_from("<IIQ", entry, at)
    if kind != _GGUF_ARRAY or elem != _GGUF_STRING:
        return {}
    at += 16
    found: dict[str, int] = {}
    for tid in range(count):
        (n,) = struct.unpack_from("<Q", entry, at)
        at += 8
        # FIM tokens are short: compare only pieces of a plausible length
        if n <= 24:
            part = wanted.get(entry[at : at + n])
            if part is not None and part not in found:
                found[part] = tid
        at += n
    return found

"""Which installed models share a vocabulary, read from their files without loading them:
`localrun ls` and `show` mark the smaller one of such a pair as a draft model for the
bigger one (speculative decoding, `--draft`). The engine's check when a pair loads
(localrun.speculation.draft_model.check_pair, token by token) stays the authority: this
is a fingerprint, and two files of one tokenizer written by different converters may
differ here and still pair.

A GGUF's fingerprint hashes the raw bytes of its `tokenizer.ggml.tokens` entry (a few
MB, read straight from the file) with its BOS and EOS ids; an MLX folder's, the
vocabulary and added tokens of its tokenizer.json.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def fingerprint(path: str | os.PathLike[str]) -> str | None:
    """The vocabulary's fingerprint, or None when the model's files do not say (no token
    list, an unreadable tokenizer)."""
    p = Path(path)
    try:
        return _mlx_fingerprint(p) if p.is_dir() else _gguf_fingerprint(p)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _gguf_fingerprint(path: Path) -> str | None:
    from localrun.model.gguf_header import read_header

    header = read_header(path)
    span = header.kv_spans.get("tokenizer.ggml.tokens")
    if span is None:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(span[0])
        h.update(f.read(span[1] - span[0]))
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        h.update(repr(header.metadata.get(key)).encode())
    return "gguf:" + h.hexdigest()


def _mlx_fingerprint(folder: Path) -> str | None:
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        return None
    data = json.loads(tokenizer.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
    text = json.dumps([sorted(vocab.items(), key=lambda kv: kv[1]) if isinstance(vocab, dict) else vocab, added])
    return "mlx:" + hashlib.sha256(text.encode()).hexdigest()


def draft_pairs(models) -> dict[str, list[str]]:
    """For each model (objects with .name, .path, .size_bytes), the names of the bigger
    installed models of the same vocabulary it can draft for."""
    prints = {m.name: fingerprint(m.path) for m in models}
    pairs: dict[str, list[str]] = {}
    for m in models:
        mine = prints[m.name]
        if mine is None:
            continue
        bigger = [o.name for o in models if o.name != m.name and prints[o.name] == mine and o.size_bytes > m.size_bytes]
        if bigger:
            pairs[m.name] = bigger
    return pairs

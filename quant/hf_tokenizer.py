"""Turn a Hugging Face `tokenizer.json` (byte-level BPE) into GGUF tokenizer metadata.

The inverse of quant/gguf_tokenizer.py: llama.cpp needs the vocabulary, the merges,
a type per token, the special token ids and, crucially, the *name* of the
pre-tokenizer split (`tokenizer.ggml.pre`), because a GGUF does not store the split
rule itself. We name it by recognising the rule the tokenizer.json declares; a split we
cannot name exactly is refused, since a wrong name tokenizes differently without any
error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localrun.errors import MalformedModelError, UnsupportedFormatError

# llama.cpp token types
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# Split regexes as tokenizer.json files spell them, by llama.cpp pre-tokenizer name.
_LLAMA3_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # the spelling localrun's own GGUF -> MLX converter writes (per-case contractions)
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_QWEN2_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _pre_name(pre: dict | None) -> str:
    """The llama.cpp `tokenizer.ggml.pre` name of a tokenizer.json pre_tokenizer."""
    if pre is None:
        raise UnsupportedFormatError("the tokenizer has no pre-tokenizer; only byte-level BPE can be converted")
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in _LLAMA3_REGEXES:
            return "llama-bpe"
        if regex in _QWEN2_REGEXES:
            return "qwen2"
    raise UnsupportedFormatError(
        f"this tokenizer's pre-tokenizer ({' + '.join(map(str, kinds))}) is not one localrun can name "
        "for llama.cpp yet; supported: GPT-2, SmolLM, Llama 3 and Qwen2 splits"
    )


def _token_id(vocab: dict[str, int], spec: Any) -> int | None:
    if isinstance(spec, dict):
        spec = spec.get("content")
    return vocab.get(spec) if isinstance(spec, str) else None


def tokenizer_metadata(folder: Path, vocab_size: int, config: dict) -> dict[str, Any]:
    """GGUF `tokenizer.*` keys (name -> value) for the tokenizer files in `folder`."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedFormatError(f"{folder} has no tokenizer.json; only fast (tokenizer.json) tokenizers convert")
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
        tc_path = folder / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MalformedModelError(f"{folder}: a tokenizer file is not valid JSON ({e})") from e
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise UnsupportedFormatError(
            f"{folder.name}'s tokenizer is {model.get('type')}"
            f"{' with byte fallback (SentencePiece style)' if model.get('byte_fallback') else ''}; "
            "only byte-level BPE tokenizers can be converted to GGUF yet"
        )
    pre = _pre_name(tj.get("pre_tokenizer"))

    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {t["content"]: t for t in tj.get("added_tokens", [])}
    for content, t in added.items():
        vocab[content] = int(t["id"])
    n = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [UNUSED] * n
    for tok, i in vocab.items():
        tokens[i] = tok
        a = added.get(tok)
        types[i] = NORMAL if a is None else (CONTROL if a.get("special") else USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    ids = {
        "bos": _token_id(vocab, tc.get("bos_token")), "eos": _token_id(vocab, tc.get("eos_token")),
        "unknown": _token_id(vocab, tc.get("unk_token")), "padding": _token_id(vocab, tc.get("pad_token")),
    }
    for key in ("bos", "eos"):  # config.json's ids are what generation uses: they win
        cid = config.get(f"{key}_token_id")
        if isinstance(cid, list):
            cid = cid[0] if cid else None
        if cid is not None:
            ids[key] = int(cid)
    for key, value in ids.items():
        if value is not None:
            meta[f"tokenizer.ggml.{key}_token_id"] = int(value)
    if "add_bos_token" in tc:
        meta["tokenizer.ggml.add_bos_token"] = bool(tc["add_bos_token"])
    else:  # no flag: a BOS in the post-processor's template means one is added
        single = ((tj.get("post_processor") or {}).get("single")) or []
        meta["tokenizer.ggml.add_bos_token"] = any("SpecialToken" in p for p in single[:1])
    if "add_eos_token" in tc:
        meta["tokenizer.ggml.add_eos_token"] = bool(tc["add_eos_token"])
    template = tc.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template:
        meta["tokenizer.chat_template"] = template
    return meta

"""Rebuild a Hugging Face tokenizer from the vocabulary a GGUF file carries.

A GGUF keeps the tokenizer as metadata (`tokenizer.ggml.*`), not as `tokenizer.json`.
MLX loads models through Hugging Face's tokenizer classes, so converting a GGUF to
MLX means rebuilding `tokenizer.json` from that metadata, and the rebuilt tokenizer
must cut text exactly as llama.cpp does or the converted model sees different ids.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is handled. Its pre-tokenizer
(how text is split before merging) is not stored as a rule in the GGUF, only named by
`tokenizer.ggml.pre`; each name we support maps to the split llama.cpp applies for it.
Everything else raises UnsupportedFormatError instead of producing a tokenizer that
silently disagrees with llama.cpp.

This module works on a plain dict of metadata (key -> decoded value) so that it does
not depend on GGUFReader and can be tested with a synthetic vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from localrun.errors import MalformedModelError, UnsupportedFormatError

# llama.cpp's token types (llama_token_type): 3 = control (<|im_start|>, <s>),
# 4 = user-defined. Both are matched whole in text when special parsing is on, which
# is what a Hugging Face "special" added token does.
_CONTROL = 3
_USER_DEFINED = 4

# The Llama 3 split: contractions (either case), letters with at most one leading
# non-letter, numbers in runs of up to three digits, punctuation runs with trailing
# newlines, then whitespace. The contractions are spelled out per case, as llama.cpp
# does, rather than with (?i:...), whose Unicode case folding would also match a few
# non-ASCII letters llama.cpp does not.
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# `tokenizer.ggml.pre` names, spelled as llama.cpp spells them, grouped by the split
# llama.cpp applies. Only names whose whole behaviour we reproduce are listed.
_GPT2_NAMES = ("gpt-2",)
_SMOLLM_NAMES = ("smollm",)
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3")
SUPPORTED_PRE = _GPT2_NAMES + _SMOLLM_NAMES + _LLAMA3_NAMES


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool, bool]:
    """For a `tokenizer.ggml.pre` name: (pre-tokenizer, ignore_merges, default add_bos).

    ignore_merges: for the Llama 3 family llama.cpp looks a whole pre-token up in the
    vocabulary before merging (as Hugging Face's Llama 3 tokenizer.json does with
    `ignore_merges: true`); the outcome can differ from merging step by step.
    default add_bos: what llama.cpp assumes when the GGUF has no add_bos_token key.
    """
    # GPT-2's own split (contractions, letters, numbers, punctuation, spaces) is the
    # regex ByteLevel applies when use_regex=True.
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_NAMES:
        return gpt2, False, False
    if pre in _SMOLLM_NAMES:
        # SmolLM splits every digit on its own before the GPT-2 split; this is the
        # Sequence the original SmolLM2 tokenizer.json declares.
        seq = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
        return seq, False, False
    if pre in _LLAMA3_NAMES:
        seq = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                # The split is done above; ByteLevel only maps bytes to symbols here.
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        return seq, True, True
    raise UnsupportedFormatError(
        f"this GGUF's tokenizer uses the pre-tokenizer '{pre}', which cannot be converted "
        f"yet; supported: {', '.join(SUPPORTED_PRE)}"
    )


def _require(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise MalformedModelError(f"the GGUF has no '{key}'; its tokenizer cannot be rebuilt")
    return meta[key]


def _token_or_none(tokens: list[str], meta: Mapping[str, Any], key: str) -> str | None:
    idx = meta.get(key)
    if idx is None:
        return None
    if not 0 <= int(idx) < len(tokens):
        raise MalformedModelError(f"the GGUF's {key} = {idx} is outside its vocabulary")
    return tokens[int(idx)]


def _pre_name(meta: Mapping[str, Any]) -> str:
    # A GGUF without the key predates it; llama.cpp then uses its "default" split,
    # which we do not reproduce, so it ends in the refusal below.
    return str(meta.get("tokenizer.ggml.pre", "default"))


def _add_bos(meta: Mapping[str, Any]) -> bool:
    """Whether llama.cpp prepends BOS: the GGUF's flag, else the pre-type's default."""
    flag = meta.get("tokenizer.ggml.add_bos_token")
    return bool(flag) if flag is not None else _pre_tokenizer(_pre_name(meta))[2]


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's tokenizer for this metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedFormatError(
            f"this GGUF's tokenizer model is '{kind}'; only byte-level BPE ('gpt2') "
            "tokenizers can be converted to MLX yet"
        )
    tokens: list[str] = list(_require(meta, "tokenizer.ggml.tokens"))
    merges: list[str] = list(_require(meta, "tokenizer.ggml.merges"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise MalformedModelError("the GGUF's token_type and tokens arrays differ in length")
    pre_tok, ignore_merges, _ = _pre_tokenizer(_pre_name(meta))

    # Some vocabularies repeat a string (padding fillers); keep the first id, as a
    # dict must, and let the later duplicates stay unreachable by text, as in llama.cpp.
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    # Byte-level symbols never include a real space (it is mapped to 'Ġ'), so one
    # space separates the two halves of a merge.
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise MalformedModelError(f"the GGUF has a malformed merge rule {m!r}")
        pairs.append((left, right))

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                   ignore_merges=ignore_merges)
    )
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()

    # Registered as added tokens so that text like "<|im_start|>" becomes that one id,
    # as llama.cpp does with parse_special; normalized=False keeps them literal.
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_special_tokens(specials)

    # BOS/EOS insertion lives in the post-processor so any loader of tokenizer.json
    # (not only transformers, which reads add_bos_token) adds the same ids llama.cpp does.
    bos = _token_or_none(tokens, meta, "tokenizer.ggml.bos_token_id")
    eos = _token_or_none(tokens, meta, "tokenizer.ggml.eos_token_id")
    add_bos = _add_bos(meta) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        pre = [bos] if add_bos else []
        post = [eos] if add_eos else []
        single = " ".join(pre + ["$A"] + post)
        second = [t + ":1" for t in pre] + ["$B:1"] + [t + ":1" for t in post]
        pair = " ".join(pre + ["$A"] + post + second)
        special = {t: vocab[t] for t in pre + post}
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(special.items())
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(meta: Mapping[str, Any], out_dir: Path, model_max_length: int) -> dict[str, Any]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    Returns the special token ids ({"bos_token_id", "eos_token_id"}) for config.json.
    """
    tok = build_tokenizer(meta)
    tok.save(str(out_dir / "tokenizer.json"))

    tokens = meta["tokenizer.ggml.tokens"]
    names = {
        "bos_token": _token_or_none(tokens, meta, "tokenizer.ggml.bos_token_id"),
        "eos_token": _token_or_none(tokens, meta, "tokenizer.ggml.eos_token_id"),
        "unk_token": _token_or_none(tokens, meta, "tokenizer.ggml.unknown_token_id"),
        "pad_token": _token_or_none(tokens, meta, "tokenizer.ggml.padding_token_id"),
    }
    names = {k: v for k, v in names.items() if v is not None}

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(model_max_length),
        "add_bos_token": _add_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        # llama.cpp does not strip spaces around punctuation when decoding byte-level
        # BPE, and neither should the MLX side.
        "clean_up_tokenization_spaces": False,
        **names,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(names, indent=2, ensure_ascii=False) + "\n")

    def _id(key: str) -> int | None:
        v = meta.get(key)
        return None if v is None else int(v)

    return {
        "bos_token_id": _id("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _id("tokenizer.ggml.eos_token_id"),
        "pad_token_id": _id("tokenizer.ggml.padding_token_id"),
    }

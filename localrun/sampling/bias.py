"""Logit bias, the one parser: every form a client or a user writes, checked and bounded.

Forms: OpenAI's {"15043": -5}, llama-server's [[15043, -5], ["Hello", false]], a Python
{15043: -5.0}, and the CLI's / chat panel's "ID=BIAS" and "TEXT=BIAS" (`bias_item`). A
key is a token id (an int or a string of digits) or text, whose tokens the engine biases
once the model is known; a bias is a finite number, or false / -inf for "never".
Duplicate keys add up, as llama-server's repeated entries do.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import BadRequestError
from .declare import MAX_BIAS_ENTRIES, MAX_BIAS_TEXT_CHARS, MAX_TOKEN_ID, show

# a bias this large already decides the token; clamping keeps sums and float32 logits finite
MAX_ABS_BIAS = 1e30


def parse_logit_bias(value, name: str = "logit_bias") -> tuple[dict[int, float], dict[str, float]]:
    """({token id: bias}, {text: bias}) from a dict or a list of pairs; BadRequestError
    naming `name` for anything else, and past the caps (1024 entries, 256 characters a
    text key, ids below 2**31)."""
    if isinstance(value, dict):
        pairs = value.items()
    elif isinstance(value, (list, tuple)):
        pairs = value
    else:
        raise BadRequestError(f"{name} must map token ids or text to numbers, got {show(value)}")
    if len(value) > MAX_BIAS_ENTRIES:
        raise BadRequestError(f"{name} may hold at most {MAX_BIAS_ENTRIES} entries, got {len(value)}")
    ids: dict[int, float] = {}
    text: dict[str, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BadRequestError(f"{name} entries must be [token id or text, bias] pairs, got {show(pair)}")
        key, bias = _key(pair[0], name), _bias(pair[1], pair[0], name)
        into = text if isinstance(key, str) else ids
        into[key] = _clamp(into[key] + bias) if key in into else bias
    return ids, text


def bias_item(item: str) -> tuple[str, float]:
    """One "ID=BIAS" or "TEXT=BIAS" as typed on the command line (the key is everything
    before the last '=', so text may hold '='); ValueError when it is neither."""
    key, sep, value = item.rpartition("=")
    if not sep or not key:
        raise ValueError(item)
    return key, float(value)


def _is_id(text: str) -> bool:
    """Digits (ASCII only: '²'.isdigit() is true too), with a '-' that makes it a bad id
    rather than text, as llama-server reads object keys."""
    digits = text[1:] if text.startswith("-") else text
    return digits.isascii() and digits.isdigit()


def _clamp(bias: float) -> float:
    return bias if math.isinf(bias) else max(-MAX_ABS_BIAS, min(MAX_ABS_BIAS, bias))


def _key(key, name: str) -> int | str:
    raw = key
    if isinstance(key, np.integer):
        key = int(key)
    if isinstance(key, str) and _is_id(key):
        # JSON object keys arrive as strings; a 5000-digit one must not reach int()'s limit
        key = int(key) if len(key) <= 20 else None
    elif isinstance(key, str) and key:
        if len(key) > MAX_BIAS_TEXT_CHARS:
            raise BadRequestError(f"{name}: a text key may be at most {MAX_BIAS_TEXT_CHARS} characters, got {show(key)}")
        return key
    if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key <= MAX_TOKEN_ID:
        raise BadRequestError(f"{name} keys must be token ids (integers 0..{MAX_TOKEN_ID}) or text, got {show(raw)}")
    return key


def _bias(bias, key, name: str) -> float:
    if bias is False:
        return -math.inf
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) or bias == math.inf:
        raise BadRequestError(f"{name} for token {show(key)} must be a number (or false = never), got {show(bias)}")
    return _clamp(float(bias))

"""User-facing errors.

Every foreseeable mistake (a wrong path, a file we cannot read, a prompt too long for
the context, a bad parameter) raises one of these. The CLI prints `error: <message>`
on one line and exits with `exit_code`; the server (later) maps `http_status`.
A message says what went wrong and what to do about it.

At the end, two readers of values a client sent, shared by every layer that checks them:
`parse_client_json` and `client_integer`.
"""

from __future__ import annotations

import json
from typing import Callable


class LocalrunError(Exception):
    """Base of every error a user may see; never a bug."""

    exit_code = 1
    http_status = 400


class ModelNotFoundError(LocalrunError):
    exit_code = 2
    http_status = 404


class UnsupportedFormatError(LocalrunError):
    """The path exists but is not a model format a backend can load."""

    exit_code = 2


class MalformedModelError(UnsupportedFormatError):
    """A model file that claims a format but breaks its rules (a corrupt GGUF)."""


class BackendUnavailableError(LocalrunError):
    """The runtime a model needs (llama-cpp-python, mlx) is not installed or failed."""

    exit_code = 3
    http_status = 500


class ContextExceededError(LocalrunError):
    """The prompt does not fit in the context window."""


class BadRequestError(LocalrunError):
    """An invalid parameter value; the message names the parameter."""


class ModelLoadError(LocalrunError):
    """A backend could not load a model or make its context (memory, device, a file the
    runtime rejects)."""

    exit_code = 3
    http_status = 500


class DecodeError(LocalrunError):
    """A forward pass failed (not an interrupt): e.g. llama_decode found no room in the
    KV cache or reported an internal error. The sequences it touched hold no new tokens."""

    exit_code = 3
    http_status = 500


class CacheNotTrimmableError(LocalrunError):
    """This sequence's KV cache cannot be cut back to fewer positions (an MLX rotating
    window that has wrapped, a recurrent state). Callers that can re-read the history
    clear the sequence instead; anything else is a bug, hence 500."""

    exit_code = 3
    http_status = 500


def parse_client_json(text: str | bytes, invalid: Callable[[json.JSONDecodeError], str], too_deep: str):
    """`json.loads` of JSON text a client sent, whose mistakes are the client's: text that
    is not JSON raises BadRequestError(invalid(the decode error)), and text nested past
    Python's recursion limit (json.loads recurses once per nested object or array) raises
    BadRequestError(too_deep), not a RecursionError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequestError(invalid(exc)) from None
    except RecursionError:
        raise BadRequestError(too_deep) from None


def client_integer(v) -> int | None:
    """`v` as an int, or None when it is not an integer: a JSON client may send 40.0 for
    40 (JSON has one number type), and a bool is none, though Python counts it as one."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    return None

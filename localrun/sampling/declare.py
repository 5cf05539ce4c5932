"""How a sampler parameter is declared: `param(...)` on a `SamplingParams` field holds
everything the rest of localrun derives from it (validation, the CLI flag, the server's
field map, the chat panel's input), so adding a parameter is one declaration.

    top_n_sigma: float = param(-1.0, "float", lambda v: v <= BIG, "at most 1e6 (0 or below, e.g. -1, = off)",
                               flag="--top-n-sigma", help="keep logits within n standard deviations of the top one")

Kinds: "int", "float" (finite), "strings" (DRY's breakers), "order" (`samplers`), "bias"
(logit bias: ids and text). The caps here bound what one request can make the shared
scheduler step do, and keep every number inside what numpy's int64/float32 hold.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import BadRequestError, client_integer

BIG = 1e6  # far past any useful weight or temperature; float32 logits stay finite
MAX_WINDOW = 1 << 20  # token windows (repeat_last_n, ...): a million tokens; -1 = the whole context
MAX_TOP_K = 2**31 - 1  # llama.cpp's int32; any k past the vocabulary keeps every token
MAX_N_PROBS = 20  # OpenAI's top_logprobs cap: each one is a Python object per token
MAX_SEED = 2**64 - 1  # a uint64
MAX_BREAKERS = 32  # DRY sequence breakers per request
MAX_BREAKER_BYTES = 40  # llama.cpp's own limit per breaker (it truncates; we refuse)
MAX_SAMPLERS = 32  # names in `samplers` (there are 10 stages)
MAX_BIAS_ENTRIES = 1024  # logit_bias entries, ids and text keys together
MAX_BIAS_TEXT_CHARS = 256  # one text key of logit_bias
MAX_TOKEN_ID = 2**31 - 1  # llama.cpp's llama_token is an int32
INT64 = 2**63

KINDS = ("int", "float", "strings", "order", "bias")


@dataclass(frozen=True)
class Param:
    """One sampler parameter. `name` is the field's name, which is also llama-server's
    name for it in a request body (and Ollama's, inside `options`)."""

    name: str
    kind: str
    default: Any
    valid: Callable[[Any], bool] | None  # checked after the kind's own checks
    means: str  # what valid means, said in the error
    flag: str | None  # the CLI flag (`localrun run/chat`); None: not on the command line
    help: str  # the flag's help; the chat panel's label comes from `label` or the flag
    body: bool  # read from a request body under `name`; False: passed another way (say how in `note`)
    label: str | None  # the chat panel's label where the flag does not say it well
    openai: str | None  # the name in OpenAI's own API, where OpenAI defines the parameter
    note: str  # why a parameter has no flag or no body field

    @property
    def optional(self) -> bool:
        """None is a value (it means 'pick one', as seed=None does)."""
        return self.default is None and self.kind == "int"

    def check(self, value):
        """`value` checked against the kind and range, normalised (40.0 -> 40); a
        BadRequestError naming the parameter otherwise."""
        if self.kind == "int":
            value = _integer(self, value)
        elif self.kind == "float":
            value = _number(self, value)
        elif self.kind == "strings":
            value = _breakers(self, value)
        if value is not None and self.valid is not None and not self.valid(value):
            raise BadRequestError(f"{self.name} must be {self.means}, got {show(value)}")
        return value


def param(default, kind: str, valid: Callable[[Any], bool] | None, means: str, *, flag: str | None, help: str = "",
          body: bool = True, label: str | None = None, openai: str | None = None, note: str = ""):
    """A dataclass field carrying its `Param` (named when `SamplingParams` is defined)."""
    if kind not in KINDS:
        raise ValueError(f"unknown parameter kind {kind!r}")
    if (flag is None or not body) and not note:
        raise ValueError("a parameter without a flag or a body field needs a note saying how it is set")
    spec = Param("", kind, default, valid, means, flag, help, body, label, openai, note)
    if isinstance(default, (list, dict, tuple)):
        make = (lambda: list(default)) if isinstance(default, (list, tuple)) else (lambda: dict(default))
        return field(default_factory=make, metadata={"param": spec})
    return field(default=default, metadata={"param": spec})


def _integer(p: Param, v):
    if v is None and p.optional:
        return None
    n = client_integer(v)  # JSON clients send 40.0
    if n is None:
        raise BadRequestError(f"{p.name} must be an integer, got {show(v)}")
    if not -INT64 <= n < INT64 and not (p.valid and p.valid(n)):  # only the seed is a uint64
        raise BadRequestError(f"{p.name} must fit in a 64-bit integer, got {show(n)}")
    return n


def _number(p: Param, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequestError(f"{p.name} must be a number, got {show(v)}")
    if not math.isfinite(v):
        raise BadRequestError(f"{p.name} must be a finite number, got {show(v)}")
    return v


def _breakers(p: Param, v) -> list[str]:
    """DRY's sequence breakers: refused past llama.cpp's 40 bytes rather than truncated,
    because a cut breaker matches text the client never named."""
    if isinstance(v, (list, tuple)) and len(v) > MAX_BREAKERS:  # counted before anything is read
        raise BadRequestError(f"{p.name} may hold at most {MAX_BREAKERS} strings, got {len(v)}")
    if not isinstance(v, (list, tuple)) or not all(isinstance(b, str) for b in v):
        raise BadRequestError(f"{p.name} must be a list of strings, got {show(v)}")
    for i, b in enumerate(v):
        if len(b) > MAX_BREAKER_BYTES or len(b.encode("utf-8")) > MAX_BREAKER_BYTES:
            raise BadRequestError(f"{p.name}[{i}] must be at most {MAX_BREAKER_BYTES} bytes of UTF-8, got {show(b)}")
    return list(v)


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = 6


def show(v) -> str:
    """A value as an error message quotes it: short however large it is (reprlib stops
    early, so a 10 MB list costs nothing to quote)."""
    return _SHORT.repr(v)

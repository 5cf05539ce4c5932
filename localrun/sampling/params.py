"""SamplingParams: llama-server's sampling parameters, validated on construction, and
the stage names `samplers` may order."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from ..errors import BadRequestError
from .dry import DRY_BREAKERS

DEFAULT_SAMPLERS = ("penalties", "dry", "logit_bias", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_ALIASES = {"typical_p": "typ_p", "typical": "typ_p", "typ": "typ_p", "nucleus": "top_p", "temp": "temperature"}
_STAGES = frozenset(DEFAULT_SAMPLERS)
_ARGMAX_CHANGING = ("penalties", "dry", "logit_bias")


@dataclass
class SamplingParams:
    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    min_keep: int = 0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # llama-server's string form ({"Hello": -5} or [["Hello", -5]]): the bias goes to every
    # token of the text; the engine resolves it with the model's tokenizer
    logit_bias_text: dict[str, float] = field(default_factory=dict)
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_BREAKERS))
    samplers: list[str] | None = None
    n_probs: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _INT_FIELDS and v is not None:
                if isinstance(v, float) and v.is_integer():
                    setattr(self, f.name, int(v))  # JSON clients send 40.0
                elif not isinstance(v, int) or isinstance(v, bool):
                    raise BadRequestError(f"{f.name} must be an integer, got {v!r}")
            elif f.name in _FLOAT_FIELDS:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise BadRequestError(f"{f.name} must be a number, got {v!r}")
                if not math.isfinite(v):
                    raise BadRequestError(f"{f.name} must be a finite number, got {v!r}")
        for name, ok, want in _RANGES:
            if not ok(getattr(self, name)):
                raise BadRequestError(f"{name} must be {want}, got {getattr(self, name)!r}")
        self.logit_bias, text = _check_logit_bias(self.logit_bias)
        _, more = _check_logit_bias(self.logit_bias_text)
        for t, b in more.items():
            text[t] = text.get(t, 0.0) + b
        self.logit_bias_text = text
        breakers = self.dry_sequence_breakers
        if not isinstance(breakers, (list, tuple)) or not all(isinstance(b, str) for b in breakers):
            raise BadRequestError(f"dry_sequence_breakers must be a list of strings, got {breakers!r}")
        _ = self.order  # validates `samplers` now, not at the first token

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 and self.mirostat == 0

    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    @property
    def dry_on(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_base >= 1.0 and self.dry_penalty_last_n != 0

    @property
    def order(self) -> tuple[str, ...]:
        """The resolved stage order: canonical names, logit_bias placed."""
        if self.samplers is None:
            return DEFAULT_SAMPLERS
        names = self.samplers.split(";") if isinstance(self.samplers, str) else self.samplers
        if not isinstance(names, (list, tuple)):
            raise BadRequestError(f"samplers must be a list of names, got {self.samplers!r}")
        out: list[str] = []
        for raw in names:
            if not isinstance(raw, str):
                raise BadRequestError(f"samplers must be a list of names, got {raw!r}")
            name = raw.strip().lower().replace("-", "_")
            name = _ALIASES.get(name, name)
            if name not in _STAGES:
                raise BadRequestError(f"samplers: unknown sampler {raw!r}; known: {', '.join(DEFAULT_SAMPLERS)}")
            out.append(name)
        if "logit_bias" not in out:
            at = next((i for i, s in enumerate(out) if s not in ("penalties", "dry")), len(out))
            out.insert(at, "logit_bias")
        return tuple(out)


_INT_FIELDS = frozenset(
    {"top_k", "min_keep", "repeat_last_n", "mirostat", "dry_allowed_length", "dry_penalty_last_n", "n_probs", "seed"}
)
_RANGES = (  # (field, valid, what valid means), checked after the type checks
    ("temperature", lambda v: v >= 0, ">= 0 (0 = greedy)"),
    ("dynatemp_range", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("dynatemp_exponent", lambda v: v >= 0, ">= 0"),
    ("top_k", lambda v: v >= -1, "0 or -1 (off) or a positive count"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("typical_p", lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
    ("xtc_probability", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("xtc_threshold", lambda v: 0 <= v <= 1, "in [0, 1] (above 0.5 = off)"),
    ("min_keep", lambda v: v >= 0, ">= 0"),
    ("repeat_penalty", lambda v: v > 0, "> 0 (1 = off)"),
    ("repeat_last_n", lambda v: v >= -1, "-1 (whole context), 0 (off) or a count"),
    ("mirostat", lambda v: v in (0, 1, 2), "0 (off), 1 or 2"),
    ("mirostat_tau", lambda v: v >= 0, ">= 0"),
    ("mirostat_eta", lambda v: v >= 0, ">= 0"),
    ("dry_multiplier", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("dry_base", lambda v: v >= 0, ">= 0 (below 1 = off)"),
    ("dry_allowed_length", lambda v: v >= 0, ">= 0"),
    ("dry_penalty_last_n", lambda v: v >= -1, "-1 (whole context), 0 (off) or a count"),
    ("n_probs", lambda v: v >= 0, ">= 0"),
    ("seed", lambda v: v is None or v >= -1, "an integer >= 0, or -1 / None for a random one"),
)
_FLOAT_FIELDS = frozenset(
    {"temperature", "dynatemp_range", "dynatemp_exponent", "top_p", "min_p", "typical_p", "xtc_probability",
     "xtc_threshold", "repeat_penalty", "presence_penalty", "frequency_penalty", "mirostat_tau", "mirostat_eta",
     "dry_multiplier", "dry_base"}
)


def _check_logit_bias(bias) -> tuple[dict[int, float], dict[str, float]]:
    """A dict {id: bias} or llama-server's [[id, bias], ...]; `false` means -inf (never).
    A key that is text, not an id, biases the tokens of that text: returned apart."""
    items = bias.items() if isinstance(bias, dict) else bias
    out: dict[int, float] = {}
    text: dict[str, float] = {}
    try:
        for tok, b in items:
            if isinstance(tok, str) and tok.isdigit():
                tok = int(tok)  # JSON object keys arrive as strings
            if isinstance(tok, np.integer):
                tok = int(tok)
            is_text = isinstance(tok, str) and tok != ""
            if not is_text and (not isinstance(tok, int) or isinstance(tok, bool) or tok < 0):
                raise BadRequestError(f"logit_bias keys must be token ids (integers >= 0) or text, got {tok!r}")
            b = -math.inf if b is False else b
            if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b) or b == math.inf:
                raise BadRequestError(f"logit_bias for token {tok!r} must be a number (or false = never), got {b!r}")
            into = text if is_text else out
            into[tok] = into.get(tok, 0.0) + float(b)
    except (TypeError, ValueError):
        raise BadRequestError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    return out, text

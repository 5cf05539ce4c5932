"""SamplingParams: llama-server's sampling parameters, each declared once (`param`: kind,
default, valid range, CLI flag, help), validated on construction, and the stage names
`samplers` may order.

Everything else is derived from these declarations through `PARAMETERS`: the CLI flags
(`localrun.cli`), the server's field map (`localrun.server.fields`) and the chat app's
settings panel (`localrun.tui.settings`). A new parameter is one `param(...)` here (and,
for a new stage, its function in `stages` and its line in `Sampler._stage`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from typing import Callable, Sequence

from ..errors import BadRequestError
from .bias import _clamp, parse_logit_bias
from .declare import (
    BIG,
    MAX_BIAS_ENTRIES,
    MAX_N_PROBS,
    MAX_SAMPLERS,
    MAX_SEED,
    MAX_TOP_K,
    MAX_WINDOW,
    Param,
    param,
    show,
)
from .breakers import DRY_BREAKERS

DEFAULT_SAMPLERS = (
    "penalties", "dry", "logit_bias", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
)
_ALIASES = {"typical_p": "typ_p", "typical": "typ_p", "typ": "typ_p", "nucleus": "top_p", "temp": "temperature"}
_STAGES = frozenset(DEFAULT_SAMPLERS)
_ARGMAX_CHANGING = ("penalties", "dry", "logit_bias")

_WINDOW = f"-1 (whole context), 0 (off) or a count up to {MAX_WINDOW}"


def _within(lo, hi):
    return lambda v: lo <= v <= hi


@dataclass
class SamplingParams:
    """One generation's sampling parameters, under llama-server's names; the declaration
    order is the order the CLI's help and the chat's settings panel list them in."""

    temperature: float = param(0.8, "float", _within(0, BIG), ">= 0 and at most 1e6 (0 = greedy)",
                               flag="--temperature", help="0 = greedy", openai="temperature")
    top_k: int = param(40, "int", _within(-1, MAX_TOP_K), f"0 or -1 (off) or a positive count up to {MAX_TOP_K}",
                       flag="--top-k", help="0 or -1 = off")
    top_p: float = param(0.95, "float", lambda v: 0 < v <= 1, "in (0, 1]", flag="--top-p", openai="top_p")
    min_p: float = param(0.05, "float", _within(0, 1), "in [0, 1]", flag="--min-p")
    top_n_sigma: float = param(-1.0, "float", lambda v: v <= BIG, "at most 1e6 (0 or below, e.g. -1, = off)",
                               flag="--top-n-sigma", help="keep logits within n standard deviations of the top one; -1 = off")
    typical_p: float = param(1.0, "float", lambda v: 0 < v <= 1, "in (0, 1] (1 = off)",
                             flag="--typical-p", help="locally typical sampling; 1 = off")
    xtc_probability: float = param(0.0, "float", _within(0, 1), "in [0, 1]",
                                   flag="--xtc-probability", help="exclude-top-choices chance; 0 = off")
    xtc_threshold: float = param(0.1, "float", _within(0, 1), "in [0, 1] (above 0.5 = off)", flag="--xtc-threshold")
    dynatemp_range: float = param(0.0, "float", _within(0, BIG), ">= 0 and at most 1e6 (0 = off)",
                                  flag="--dynatemp-range", help="dynamic temperature range; 0 = off")
    dynatemp_exponent: float = param(1.0, "float", _within(0, BIG), ">= 0 and at most 1e6", flag="--dynatemp-exponent")
    repeat_penalty: float = param(1.0, "float", _within(1 / BIG, BIG), "in [1e-6, 1e6] (1 = off)",
                                  flag="--repeat-penalty", help="1 = off")
    repeat_last_n: int = param(64, "int", _within(-1, MAX_WINDOW), _WINDOW,
                               flag="--repeat-last-n", help="-1 = whole context")
    presence_penalty: float = param(0.0, "float", _within(-BIG, BIG), "in [-1e6, 1e6]",
                                    flag="--presence-penalty", openai="presence_penalty")
    frequency_penalty: float = param(0.0, "float", _within(-BIG, BIG), "in [-1e6, 1e6]",
                                     flag="--frequency-penalty", openai="frequency_penalty")
    mirostat: int = param(0, "int", lambda v: v in (0, 1, 2), "0 (off), 1 or 2", flag="--mirostat", help="0 = off, 1 or 2")
    mirostat_tau: float = param(5.0, "float", _within(0, BIG), ">= 0 and at most 1e6", flag="--mirostat-tau")
    mirostat_eta: float = param(0.1, "float", _within(0, BIG), ">= 0 and at most 1e6", flag="--mirostat-eta")
    dry_multiplier: float = param(0.0, "float", _within(0, BIG), ">= 0 and at most 1e6 (0 = off)",
                                  flag="--dry-multiplier", help="DRY repetition penalty; 0 = off")
    dry_base: float = param(1.75, "float", _within(0, BIG), ">= 0 and at most 1e6 (below 1 = off)", flag="--dry-base")
    dry_allowed_length: int = param(2, "int", _within(0, MAX_WINDOW), f"in 0..{MAX_WINDOW}", flag="--dry-allowed-length")
    dry_penalty_last_n: int = param(-1, "int", _within(-1, MAX_WINDOW), _WINDOW,
                                    flag="--dry-penalty-last-n", help="-1 = whole context")
    seed: int | None = param(None, "int", _within(-1, MAX_SEED), "an integer 0..2**64-1, or -1 / None for a random one",
                             flag="--seed", help="fixed seed for reproducible sampling", openai="seed")
    dry_sequence_breakers: list[str] = param(DRY_BREAKERS, "strings", None, "a list of strings",
                                             flag="--dry-sequence-breaker", label="dry-breakers (JSON)",
                                             help="DRY sequence breaker (repeatable; replaces the defaults)")
    samplers: list[str] | None = param(None, "order", None, "a list of stage names", flag="--samplers",
                                       label="samplers (a;b;…)",
                                       help="stage order, e.g. 'penalties;dry;top_k;top_p;min_p;temperature'")
    # {id: bias} or llama-server's [[id or text, bias], ...]; `false` = never. Text keys
    # move to logit_bias_text: the engine gives their bias to every token of the text
    logit_bias: dict[int, float] = param({}, "bias", None, "token ids or text mapped to numbers",
                                         flag="--logit-bias", label="logit-bias (ID=BIAS,…)", openai="logit_bias",
                                         help="add BIAS to token ID, or to every token of TEXT with TEXT=BIAS (repeatable)")
    logit_bias_text: dict[str, float] = param({}, "bias", None, "text mapped to numbers", flag=None, body=False,
                                              note="set through logit_bias's text keys")
    min_keep: int = param(0, "int", _within(0, MAX_WINDOW), f"in 0..{MAX_WINDOW}", flag=None,
                          note="a server field only, as in llama-server (the CLI never had it)")
    n_probs: int = param(0, "int", _within(0, MAX_N_PROBS), f"in 0..{MAX_N_PROBS} (OpenAI's top_logprobs cap)",
                         flag=None, body=False, openai="top_logprobs",
                         note="each dialect passes it: llama-server's n_probs, OpenAI's logprobs/top_logprobs")

    def __post_init__(self) -> None:
        for spec in PARAMETERS:
            if spec.kind != "bias":
                setattr(self, spec.name, spec.check(getattr(self, spec.name)))
        ids, text = parse_logit_bias(self.logit_bias)
        more_ids, more_text = parse_logit_bias(self.logit_bias_text, "logit_bias_text")
        for into, more in ((ids, more_ids), (text, more_text)):
            for key, b in more.items():
                into[key] = _clamp(into[key] + b) if key in into else b
        if len(ids) + len(text) > MAX_BIAS_ENTRIES:
            raise BadRequestError(f"logit_bias may hold at most {MAX_BIAS_ENTRIES} entries, got {len(ids) + len(text)}")
        self.logit_bias, self.logit_bias_text = ids, text
        _ = self.order  # validates `samplers` now, not at the first token

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 and self.mirostat == 0

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
            raise BadRequestError(f"samplers must be a list of names, got {show(self.samplers)}")
        if len(names) > MAX_SAMPLERS:
            raise BadRequestError(f"samplers may hold at most {MAX_SAMPLERS} names, got {len(names)}")
        out: list[str] = []
        for raw in names:
            if not isinstance(raw, str):
                raise BadRequestError(f"samplers must be a list of names, got {show(raw)}")
            name = raw.strip().lower().replace("-", "_")
            name = _ALIASES.get(name, name)
            if name not in _STAGES:
                raise BadRequestError(f"samplers: unknown sampler {show(raw)}; known: {', '.join(DEFAULT_SAMPLERS)}")
            out.append(name)
        if "logit_bias" not in out:
            at = next((i for i, s in enumerate(out) if s not in ("penalties", "dry")), len(out))
            out.insert(at, "logit_bias")
        return tuple(out)

    def check_vocab(self, n_vocab: int) -> None:
        """Refuse logit-bias token ids the model does not have: a BadRequestError naming
        logit_bias. Cheap (one max over at most 1024 ids), for the request builder to
        call once the model is known."""
        if self.logit_bias:
            top = max(self.logit_bias)
            if top >= n_vocab:
                raise BadRequestError(
                    f"logit_bias: token id {top} is outside this model's vocabulary (0..{n_vocab - 1})"
                )

    def with_text_bias(self, tokenize: Callable[[str], Sequence[int]]) -> "SamplingParams":
        """These params with the text keys of logit_bias turned into token ids: every
        token of the text, tokenized as plain text (`tokenize`: str -> ids, no specials),
        gets the bias, as in llama-server. Not validated again: the ids come from the
        model's own tokenizer, and a few long texts may resolve past the entry cap."""
        if not self.logit_bias_text:
            return self
        bias = dict(self.logit_bias)
        for text, b in self.logit_bias_text.items():
            for t in {int(t) for t in tokenize(text)}:
                bias[t] = _clamp(bias[t] + b) if t in bias else b
        out = copy.copy(self)  # a shallow copy does not run __post_init__
        out.logit_bias, out.logit_bias_text = bias, {}
        return out


def _declared() -> tuple[Param, ...]:
    out = []
    for f in fields(SamplingParams):
        spec = f.metadata.get("param")
        if spec is None:
            raise TypeError(f"SamplingParams.{f.name} is not declared with param()")
        out.append(replace(spec, name=f.name))
    return tuple(out)


# every sampler parameter, in declaration order: what the CLI, the server and the chat derive from
PARAMETERS: tuple[Param, ...] = _declared()
PARAMETER = {p.name: p for p in PARAMETERS}

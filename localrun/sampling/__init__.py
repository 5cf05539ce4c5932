"""The sampler chain, shared by every backend, applied to one numpy logits row.

Parameter names and meanings are llama-server's. Default order (`DEFAULT_SAMPLERS`):

    penalties -> dry -> logit_bias -> top_k -> typ_p -> top_p -> min_p -> xtc -> temperature -> draw

`samplers` overrides the order with llama-server's names ("penalties", "dry", "top_k",
"typ_p", "top_p", "min_p", "xtc", "temperature"; aliases "typical_p", "typical",
"nucleus", "temp"; "logit_bias" may be placed too, else it goes right after the leading
penalties/dry). A stage left out of the list is off, as in llama-server.

* Greedy (temperature <= 0, mirostat off) is an argmax after the argmax-changing stages
  (penalties, DRY, logit bias, applied to the whole row wherever `samplers` puts them):
  no softmax, and no copy when nothing is penalised. Typical and XTC could move the
  argmax (XTC at random); temperature 0 means "the deterministic argmax", so they are
  ignored then, and so are the other truncations, which cannot move it.
* Mirostat (1 or 2) replaces the truncation tail: penalties, DRY and logit bias still
  apply, then plain temperature, then mirostat's own truncation. (llama.cpp's common
  chain also drops penalties and DRY under mirostat; we keep them, as older llama.cpp
  did: they are what a user asking for them means.)
* Speed: the default chain never sorts or softmaxes the whole vocabulary. Top-k first
  finds a threshold from block maxima (one O(V) pass), keeps the few logits above it,
  and partitions those, so a 262k row costs a few passes of numpy, not a sort. Without
  top-k, top-p sorts only the tokens up to where a histogram of the mass crosses p,
  mirostat v2 thresholds the logits, and whole-row exponentials run in float32.

Where this differs from llama.cpp on purpose: logit bias runs after penalties (llama.cpp
runs it first); `repeat_last_n`/`dry_penalty_last_n` = -1 mean the whole history; DRY's
sequence breakers are matched against the token text the engine supplies (`TokenText`).

Speculation: `distribution()` is the exact final distribution `sample()` draws from; it
consumes no randomness except XTC's coin (when XTC is on). `commit()` updates mirostat's
mu for a token chosen outside, `snapshot()`/`restore()` cover the RNG and mu.

Layout: `params` (SamplingParams and its validation), `stages` (the candidate set and
the truncation/temperature stages), `dry` (DRY, its sequence breakers, TokenText),
`mirostat` (v1 and v2), `sampler` (the Sampler that runs the chain).
"""

from __future__ import annotations

from ..errors import BadRequestError
from .dry import (
    _DRY_MAX_BREAKER_BYTES,
    _DRY_MAX_TAIL_TOKENS,
    DRY_BREAKERS,
    NO_BREAKERS,
    DryBreakers,
    TokenText,
    _dry_rep_limit,
    _lookup,
    _resolve_breakers,
    dry_penalties,
)
from .mirostat import _MIROSTAT_M, mirostat_v1, mirostat_v2
from .params import (
    _ALIASES,
    _ARGMAX_CHANGING,
    _FLOAT_FIELDS,
    _INT_FIELDS,
    _RANGES,
    _STAGES,
    DEFAULT_SAMPLERS,
    SamplingParams,
    _check_logit_bias,
)
from .sampler import Sampler
from .stages import (
    _Cands,
    _log_softmax,
    _logsumexp,
    _mass_head,
    _softmax,
    _top_indices,
    apply_logit_bias,
    apply_penalties,
    min_p,
    temperature,
    top_k,
    top_p,
    typical,
    xtc,
)

__all__ = [
    "DEFAULT_SAMPLERS",
    "DRY_BREAKERS",
    "NO_BREAKERS",
    "DryBreakers",
    "Sampler",
    "SamplingParams",
    "TokenText",
    "apply_logit_bias",
    "apply_penalties",
    "dry_penalties",
    "min_p",
    "mirostat_v1",
    "mirostat_v2",
    "temperature",
    "top_k",
    "top_p",
    "typical",
    "xtc",
]

"""The sampler chain, shared by every backend, applied to one numpy logits row.

Parameter names and meanings are llama-server's. Default order (`DEFAULT_SAMPLERS`):

    penalties -> dry -> logit_bias -> top_n_sigma -> top_k -> typ_p -> top_p -> min_p -> xtc
    -> temperature -> draw

(llama.cpp's default chain, logit bias placed after penalties and DRY.) `samplers`
overrides the order with llama-server's names ("penalties", "dry", "top_n_sigma",
"top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"; aliases "typical_p",
"typical", "nucleus", "temp"; "logit_bias" may be placed too, else it goes right after
the leading penalties/dry). A stage left out of the list is off, as in llama-server.

* Greedy (temperature <= 0, mirostat off) is an argmax after the argmax-changing stages
  (penalties, DRY, logit bias, applied to the whole row wherever `samplers` puts them):
  no softmax, and no copy when nothing is penalised. Typical and XTC could move the
  argmax (XTC at random); temperature 0 means "the deterministic argmax", so they are
  ignored then, and so are the other truncations (top-n-sigma among them), which
  cannot move it.
* Mirostat (1 or 2) replaces the truncation tail: penalties, DRY and logit bias still
  apply, then plain temperature, then mirostat's own truncation. (llama.cpp's common
  chain also drops penalties and DRY under mirostat; we keep them, as older llama.cpp
  did: they are what a user asking for them means.)
* Speed: the default chain never sorts or softmaxes the whole vocabulary. Top-k first
  finds a threshold from block maxima (one O(V) pass), keeps the few logits above it,
  and partitions those, so a 262k row costs a few passes of numpy, not a sort. Without
  top-k, top-p sorts only the tokens up to where a histogram of the mass crosses p,
  mirostat v2 thresholds the logits, and whole-row exponentials run in float32.
* The default chains (penalties, DRY, logit bias -> top-k -> top-p, min-p, temperature)
  run fused on whole-vocabulary rows (`fused`): after a decode the caches hold the
  weights, so each numpy call costs tens of microseconds cold; the fused path makes few,
  and gives the staged chain's candidates and draws.

Where this differs from llama.cpp on purpose: logit bias runs after penalties (llama.cpp
runs it first); `repeat_last_n`/`dry_penalty_last_n` = -1 mean the whole history; DRY's
sequence breakers are matched against the token text the engine supplies (`TokenText`).

Speculation: `distribution()` is the exact final distribution `sample()` draws from; it
consumes no randomness except XTC's coin (when XTC is on). `commit()` updates mirostat's
mu for a token chosen outside, `snapshot()`/`restore()` cover the RNG and mu.

Layout: `declare` (how a parameter is declared, and the caps), `params`
(SamplingParams: each parameter declared once; `PARAMETERS`, what the CLI, the server
and the chat app derive from), `bias` (the one logit-bias parser), `stages` (the
candidate set and the truncation/temperature stages), `breakers` (DRY's sequence
breakers, TokenText), `dry` (DRY's penalties), `mirostat` (v1 and v2), `fused` (the
default chains in a few calls), `sampler` (the Sampler that runs the chain). Imports
point one way: params -> bias, breakers, declare; stages, dry and mirostat know no
SamplingParams; fused plans from SamplingParams over stages' _Cands; sampler uses them all.
"""

from __future__ import annotations

from .bias import bias_item, parse_logit_bias
from .breakers import DRY_BREAKERS, NO_BREAKERS, DryBreakers, TokenText
from .declare import Param
from .dry import dry_penalties
from .mirostat import mirostat_v1, mirostat_v2
from .params import DEFAULT_SAMPLERS, PARAMETER, PARAMETERS, SamplingParams
from .sampler import Sampler
from .stages import (
    apply_logit_bias,
    apply_penalties,
    min_p,
    temperature,
    top_k,
    top_n_sigma,
    top_p,
    typical,
    xtc,
)

__all__ = [
    "DEFAULT_SAMPLERS",
    "DRY_BREAKERS",
    "NO_BREAKERS",
    "PARAMETER",
    "PARAMETERS",
    "DryBreakers",
    "Param",
    "Sampler",
    "SamplingParams",
    "TokenText",
    "apply_logit_bias",
    "apply_penalties",
    "bias_item",
    "dry_penalties",
    "min_p",
    "mirostat_v1",
    "mirostat_v2",
    "parse_logit_bias",
    "temperature",
    "top_k",
    "top_n_sigma",
    "top_p",
    "typical",
    "xtc",
]

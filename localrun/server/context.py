"""The context a served model gets: what an agent needs, within what the machine holds.

A coding agent's first request is 10-12k tokens of instructions and tool schemas before
the user says a word, and it believes the window the server reports. So with no `--ctx`
a served model gets its trained context, cut only where the memory model (the quant
selector's arithmetic: weights, the KV cache of every `--parallel` slot, the compute
buffers) says this machine cannot hold it; never a silent 4096.

    choice = served_context(path, n_seq=4, kv_type="f16", asked=None)
    choice.n_ctx, choice.why    # 32768, "trained context 32768; ... of 21.3 GiB free"

A request may ask for more (Ollama's `options.num_ctx`): `served_context(..., asked=N)`
gives N when it fits, else a BadRequestError saying the most that does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import BadRequestError, LocalrunError
from ..hardware import format_bytes

FALLBACK_CTX = 4096  # a model the memory model cannot read: llama.cpp's own loader decides
MIN_CTX = 16


@dataclass(frozen=True)
class ContextChoice:
    n_ctx: int  # tokens per request (per slot)
    why: str  # one line: where the number comes from


def served_context(path: str, n_seq: int, kv_type: str = "f16", asked: int | None = None,
                   fixed: int | None = None) -> ContextChoice:
    """The context of each of `n_seq` slots of the model at `path` (see the module
    docstring). `fixed` is the server's `--ctx`, which wins; `asked` a request's
    larger context (bounded by the trained context and by memory). Reads the model's
    header: call it off the event loop."""
    if fixed is not None:
        return ContextChoice(fixed, "--ctx")
    from ..quant.selector import Budget, estimate, largest_context, memory_from_env, model_shape, weights_bytes

    try:
        shape = model_shape(Path(path))
        weights = weights_bytes(Path(path))
    except (OSError, ValueError, LocalrunError):  # the loader says what is wrong with the file
        return ContextChoice(asked or FALLBACK_CTX, "the model's header could not be sized")
    budget = memory_from_env() or Budget.from_hardware()
    trained = shape.n_ctx_train
    if asked is not None:
        if not MIN_CTX <= asked <= trained:
            raise BadRequestError(f"'num_ctx' must be {MIN_CTX}..{trained} (the model's trained context), got {asked}")
        est = estimate(shape, weights, asked, budget, kv_type, n_seq=n_seq)
        if not est.fits:
            best = largest_context(shape, weights, budget, kv_type, n_seq=n_seq)
            most = f"at most {best.n_ctx}" if best else "none at all"
            raise BadRequestError(f"'num_ctx' {asked} does not fit in this machine's memory ({est.explain()});"
                                  f" {most} fits with {n_seq} slots")
        return ContextChoice(asked, f"asked for {asked}; {_cost(est, n_seq)}")
    est = estimate(shape, weights, trained, budget, kv_type, n_seq=n_seq)
    if est.fits:
        return ContextChoice(trained, f"trained context {trained}; {_cost(est, n_seq)}")
    best = largest_context(shape, weights, budget, kv_type, n_seq=n_seq)
    if best is None:  # nothing fits: let the load fail with llama.cpp's own words
        return ContextChoice(min(FALLBACK_CTX, trained), "no context fits this machine's free memory")
    return ContextChoice(best.n_ctx, f"the most of the trained {trained} that fits; {_cost(best, n_seq)}")


def _cost(est, n_seq: int) -> str:
    return (f"{format_bytes(est.weights)} weights + {format_bytes(est.kv)} KV for {n_seq} slot"
            f"{'s' if n_seq != 1 else ''} + {format_bytes(est.buffers + est.overhead)} buffers"
            f" = {format_bytes(est.total)} of {format_bytes(est.budget)} free")

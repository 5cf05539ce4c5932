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

With `serve --draft`, `served_context(..., draft=MODEL)`: the draft model loads beside
each model it pairs with at the same context and slots (Engine.load_draft), so its
weights, its own KV cache and its buffers come out of the memory first (the selector's
`without_draft`, as `fit --draft`), at every context tried. A draft whose vocabulary
size already rules the pair out is not loaded, so not counted.
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
                   fixed: int | None = None, draft: str | None = None) -> ContextChoice:
    """The context of each of `n_seq` slots of the model at `path` (see the module
    docstring). `fixed` is the server's `--ctx`, which wins; `asked` a request's
    larger context (bounded by the trained context and by memory); `draft` the
    server's --draft model (a path or store name), counted where it pairs. Reads the
    models' headers: call it off the event loop."""
    if fixed is not None:
        return ContextChoice(fixed, "--ctx")
    from ..quant.selector import (Budget, estimate, largest_context, memory_from_env, model_shape, weights_bytes,
                                  without_draft)

    try:
        shape = model_shape(Path(path))
        weights = weights_bytes(Path(path))
    except (OSError, ValueError, LocalrunError):  # the loader says what is wrong with the file
        return ContextChoice(asked or FALLBACK_CTX, "the model's header could not be sized")
    budget = memory_from_env() or Budget.from_hardware()
    trained = shape.n_ctx_train
    drafted, skipped = _draft_beside(shape, draft)
    slots = f"{n_seq} slots" + (" and the draft model" if drafted else "")

    def at(n_ctx: int):  # (the model's estimate, the draft's or None) at n_ctx
        if drafted is None:
            return estimate(shape, weights, n_ctx, budget, kv_type, n_seq=n_seq), None
        left, est_draft = without_draft(budget, drafted, n_ctx, kv_type, n_seq)
        return estimate(shape, weights, n_ctx, left, kv_type, n_seq=n_seq), est_draft

    def cost(n_ctx: int) -> str:
        est, est_draft = at(n_ctx)
        return _cost(est, n_seq) + _after_draft(est_draft) + skipped

    if asked is not None:
        if not MIN_CTX <= asked <= trained:
            raise BadRequestError(f"'num_ctx' must be {MIN_CTX}..{trained} (the model's trained context), got {asked}")
        est, est_draft = at(asked)
        if not est.fits:
            best = largest_context(shape, weights, budget, kv_type, n_seq=n_seq, draft=drafted)
            most = f"at most {best.n_ctx}" if best else "none at all"
            raise BadRequestError(f"'num_ctx' {asked} does not fit in this machine's memory"
                                  f" ({est.explain()}{_after_draft(est_draft)}); {most} fits with {slots}")
        return ContextChoice(asked, f"asked for {asked}; {cost(asked)}")
    if at(trained)[0].fits:
        return ContextChoice(trained, f"trained context {trained}; {cost(trained)}")
    best = largest_context(shape, weights, budget, kv_type, n_seq=n_seq, draft=drafted)
    if best is None:  # nothing fits: let the load fail with llama.cpp's own words
        return ContextChoice(min(FALLBACK_CTX, trained), "no context fits this machine's free memory"
                            + (" beside the draft model" if drafted else ""))
    return ContextChoice(best.n_ctx, f"the most of the trained {trained} that fits; {cost(best.n_ctx)}")


def _draft_beside(shape, draft: str | None) -> tuple[Path | None, str]:
    """(the --draft model's file when it loads beside the model, else None; a note for
    the why when there is a draft model that is not counted). check_pair refuses a pair
    whose vocabulary sizes differ by more than the padding; any other refusal needs both
    vocabularies loaded, so such a draft is counted (the cautious side)."""
    if draft is None:
        return None, ""
    from ..quant.selector import model_shape
    from ..speculation.draft_model import VOCAB_PADDING
    from ..store.local import resolve_model

    try:
        path = Path(resolve_model(draft))
        draft_vocab = model_shape(path).n_vocab
    except (OSError, ValueError, LocalrunError):  # its load will say what is wrong
        return None, "; the draft model could not be sized"
    if abs(draft_vocab - shape.n_vocab) > VOCAB_PADDING:
        return None, "; no draft model (it does not pair with this model)"
    return path, ""


def _cost(est, n_seq: int) -> str:
    return (f"{format_bytes(est.weights)} weights + {format_bytes(est.kv)} KV for {n_seq} slot"
            f"{'s' if n_seq != 1 else ''} + {format_bytes(est.buffers + est.overhead)} buffers"
            f" = {format_bytes(est.total)} of {format_bytes(est.budget)} free")


def _after_draft(est_draft) -> str:
    """What the draft model took before the budget above was left (its own KV: every slot
    at the model's context); "" without one."""
    if est_draft is None:
        return ""
    return (f" after the draft model ({format_bytes(est_draft.weights)} weights + {format_bytes(est_draft.kv)} KV"
            f" + {format_bytes(est_draft.buffers + est_draft.overhead)} buffers = {format_bytes(est_draft.total)})")

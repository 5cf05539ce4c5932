"""The `--draft MODEL` / `--draft-max N` flags of run, chat and serve: speculative decoding
with a smaller model of the same vocabulary (localrun.speculation.draft_model)."""

from __future__ import annotations

from localrun.errors import BadRequestError

DRAFT_MAX = 16  # as localrun.speculation.draft_model.DRAFT_MAX (not imported: --help stays instant)


def add_draft_flags(p) -> None:
    g = p.add_argument_group("speculative decoding with a draft model")
    g.add_argument("--draft", metavar="MODEL", default=None,
                   help="a smaller model of the same vocabulary (a .gguf, an MLX folder or an installed name) that"
                   " drafts tokens the model then verifies in one step; the output is the model's own, and"
                   " drafting stops where it does not pay on this machine")
    g.add_argument("--draft-max", type=int, default=DRAFT_MAX, metavar="N",
                   help=f"most tokens the draft model proposes a step (default {DRAFT_MAX})")


def check_draft_flags(args) -> None:
    """Refuse a bad --draft-max or a --draft that names nothing before any model loads."""
    if getattr(args, "draft_max", DRAFT_MAX) < 1:
        raise BadRequestError(f"--draft-max must be at least 1, got {args.draft_max}")
    if getattr(args, "draft", None) is not None:
        from localrun.store.local import resolve_model

        resolve_model(args.draft)  # a wrong name or path: the store's one-line error


def draft_options(args) -> dict:
    """Engine.open's keywords for the flags."""
    return {"draft": getattr(args, "draft", None), "draft_max": getattr(args, "draft_max", DRAFT_MAX)}

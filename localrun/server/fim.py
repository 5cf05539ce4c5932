"""Fill-in-the-middle prompts: what an editor's autocomplete sends (Ollama's `suffix`,
OpenAI's `suffix`, llama-server's /infill) turned into the model's FIM token layout,
prefix-suffix-middle: <PRE> prefix <SUF> suffix <MID> middle."""

from __future__ import annotations

from ..engine import Engine
from ..errors import BadRequestError

# of the context a FIM prompt may fill, the share kept for the text after the cursor
SUFFIX_SHARE = 0.25


def check_fim(engine: Engine, name: str) -> tuple[int, int, int]:
    info = engine.info
    ids = (info.fim_prefix_id, info.fim_suffix_id, info.fim_middle_id)
    if None in ids:
        raise BadRequestError(
            f"model {name} has no fill-in-the-middle tokens, so it cannot complete between a prefix and a"
            " suffix; use a code model with FIM support (e.g. Qwen2.5-Coder, StarCoder2, CodeGemma)"
        )
    return ids  # type: ignore[return-value]


def fim_tokens(
    engine: Engine,
    prefix: str,
    suffix: str,
    extra: list[tuple[str, str]] | None = None,
    middle: str = "",
    name: str = "this model",
    budget: int | None = None,
) -> list[int]:
    """The FIM prompt, cut to `budget` tokens (default: three quarters of the context):
    an editor sends whole files, and the text nearest the cursor matters most, so the
    prefix loses its start and the suffix its end."""
    pre, suf, mid = check_fim(engine, name)
    tok = lambda text: engine.tokenize(text, add_special=False) if text else []  # noqa: E731
    head = [engine.info.bos_id] if engine.info.add_bos and engine.info.bos_id is not None else []
    context = "".join(f"{filename}\n{text}\n" if filename else f"{text}\n" for filename, text in extra or [])
    prefix_ids, suffix_ids, middle_ids = tok(context + prefix), tok(suffix), tok(middle)
    budget = budget or engine.n_ctx * 3 // 4
    room = budget - len(head) - 3 - len(middle_ids)
    if room <= 0:
        raise BadRequestError(f"the text before the cursor is too long for the context ({engine.n_ctx} tokens)")
    suffix_ids = suffix_ids[: max(int(room * SUFFIX_SHARE), room - len(prefix_ids))]
    prefix_ids = prefix_ids[max(0, len(prefix_ids) - (room - len(suffix_ids))) :]
    return head + [pre] + prefix_ids + [suf] + suffix_ids + [mid] + middle_ids

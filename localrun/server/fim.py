"""Fill-in-the-middle prompts: what an editor's autocomplete sends (Ollama's `suffix`,
OpenAI's `suffix`, llama-server's /infill) turned into the model's FIM token layout.

A slot keeps the KV of the longest start its last prompt shares with the next one, so
what a keystroke changes, the text just before the cursor, costs least when it comes last:

- suffix-prefix-middle (SPM): <PRE> <SUF> suffix <MID> prefix middle, the variant of
  Bavarian et al. 2022 that Code Llama was trained on beside PSM. The text before the
  cursor is one run at the end, tokenized as one,
  so llama.vim's shape (the cursor's line in `prompt`, our `middle`) and the whole-prefix
  shape (Continue, Zed, Ollama's and OpenAI's `suffix`) are the same prompt, and a
  keystroke, a new line included, re-reads only itself.
- prefix-suffix-middle (PSM), for every other model: <PRE> prefix <SUF> suffix <MID> middle.
  In the whole-prefix shape a keystroke changes the prefix's end, so the slot re-reads
  <SUF> suffix <MID> after it (bench_serve, SmolLM2, 1.5k-token file: 137 of 1510 tokens,
  312-352 ms warm TTFT against 60 ms for llama.vim's shape, whose typing lands after <MID>).
  Moving the cursor's line after <MID> would make both shapes one cached prompt, but the
  cursor would then sit inside the middle's token run, which PSM training never shows: a
  line ending "def " ends in a lone space token, and Qwen2.5-Coder went on " multiply"
  (two spaces) where the cursor at the prefix's end gives "multiply". llama-server keeps
  the cursor there too (it even puts /infill's `prompt` before <SUF>, so its llama.vim
  shape re-reads the suffix as well): with llama.cpp 0.3.36's server, an editor sending
  the whole prefix re-read 128 of ~1480 tokens per keystroke on both servers.
"""

from __future__ import annotations

from ..engine import Engine
from ..errors import BadRequestError

# of the context a FIM prompt may fill, the share kept for the text after the cursor
SUFFIX_SHARE = 0.25
# Code Llama's FIM prefix token (its SentencePiece piece, and the plain spelling). Other FIM
# models stay PSM: Qwen2.5-Coder and DeepSeek-Coder document PSM only, CodeGemma says it
# learned SPM too but not in which layout, and how much SPM StarCoder's released models
# saw we could not confirm: an order the model did not learn costs quality, a re-read
# suffix only time. (No Code Llama is among the test models: the SPM layout is tested on
# another model's FIM tokens.)
SPM_PREFIX_TOKENS = ("▁<PRE>", "<PRE>")


def check_fim(engine: Engine, name: str) -> tuple[int, int, int]:
    info = engine.info
    ids = (info.fim_prefix_id, info.fim_suffix_id, info.fim_middle_id)
    if None in ids:
        raise BadRequestError(
            f"model {name} has no fill-in-the-middle tokens, so it cannot complete between a prefix and a"
            " suffix; use a code model with FIM support (e.g. Qwen2.5-Coder, StarCoder2, CodeGemma)"
        )
    return ids  # type: ignore[return-value]


def suffix_first(engine: Engine) -> bool:
    """Whether the model was trained on the SPM layout (see the module's docstring)."""
    return engine.backend.token_text(engine.info.fim_prefix_id) in SPM_PREFIX_TOKENS


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
    spm = suffix_first(engine)
    if spm:  # one run of text before the cursor: cut, like the prefix, from its start
        prefix, middle = prefix + middle, ""
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
    if spm:
        return head + [pre, suf] + suffix_ids + [mid] + prefix_ids + middle_ids
    return head + [pre] + prefix_ids + [suf] + suffix_ids + [mid] + middle_ids

"""Fill-in-the-middle prompts: what an editor's autocomplete sends (Ollama's `suffix`,
OpenAI's `suffix`, llama-server's /infill) turned into the model's FIM token layout.

A slot keeps the KV of the longest start its last prompt shares with the next one, so
what a keystroke changes, the text just before the cursor, costs least when it comes last:

- prefix-suffix-middle (PSM), for most models: <PRE> prefix <SUF> suffix <MID> line,
  where `line` is the cursor's line up to the cursor. Editors send that line either in
  `prompt` (llama.vim) or at the end of the whole prefix (Continue, Zed, Ollama's and
  OpenAI's `suffix`); both come out as this one prompt, so a keystroke re-reads only
  itself. With the cursor at the prefix's end instead, every keystroke re-read
  <SUF> suffix <MID> (bench_serve, Gemma-3-270M, 1.5k-token file: 137 of 1510 tokens,
  ~330 ms warm TTFT; now 1 token, 80-88 ms). A line longer than CURSOR_LINE_MAX
  characters stays in the prefix.
- suffix-prefix-middle (SPM): <PRE> <SUF> suffix <MID> prefix middle, the variant of
  Bavarian et al. 2022 that Code Llama was trained on beside PSM: all the text before
  the cursor is one run at the end.

**Token healing.** Either way the prompt ends at the cursor, inside the text the model
writes, where the cursor may cut what the model would write as one token: a line
ending "def " ends on a lone space token, and Qwen2.5-Coder went on " multiply" (two
spaces). So the prompt's last text tokens are taken off and the answer's first tokens must
write their text again (GenerationRequest.token_healing, prompt/healing.py): here the
space, and " multiply" begins the answer, which gives "multiply"; "x = math.sq" was cut
as ".s" "q" and went on "root" (math.sqroot), healed ".sqrt". llama-server keeps the
cursor at the prefix's end (it writes /infill's `prompt` before <SUF>), so both its
shapes re-read the suffix each keystroke.
"""

from __future__ import annotations

import dataclasses

from ..engine import Engine
from ..errors import BadRequestError
from ..request import GenerationRequest

# of the context a FIM prompt may fill, the share kept for the text after the cursor
SUFFIX_SHARE = 0.25
# Code Llama's FIM prefix token (its SentencePiece piece, and the plain spelling). Other FIM
# models stay PSM: Qwen2.5-Coder and DeepSeek-Coder document PSM only, CodeGemma says it
# learned SPM too but not in which layout, and how much SPM StarCoder's released models
# saw we could not confirm: an order the model did not learn costs quality, a re-read
# suffix only time. (No Code Llama is among the test models: the SPM layout is tested on
# another model's FIM tokens.)
SPM_PREFIX_TOKENS = ("▁<PRE>", "<PRE>")
# the most characters of the cursor's line moved after <MID> (PSM): a minified file's one
# line would otherwise take the middle's whole share of the context
CURSOR_LINE_MAX = 1000
MOVED_SHARE = 0.25  # nor when its tokens would take more than this share of the prompt's budget


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
    moved = ""  # the cursor's line, moved from the prefix's end to after <MID> (PSM)
    if spm:  # one run of text before the cursor: cut, like the prefix, from its start
        prefix, middle = prefix + middle, ""
    else:
        line = prefix.rfind("\n") + 1
        if len(prefix) - line <= CURSOR_LINE_MAX:
            prefix, moved = prefix[:line], prefix[line:]
    tok = lambda text: engine.tokenize(text, add_special=False) if text else []  # noqa: E731
    head = [engine.info.bos_id] if engine.info.add_bos and engine.info.bos_id is not None else []
    context = "".join(f"{filename}\n{text}\n" if filename else f"{text}\n" for filename, text in extra or [])
    budget = budget or engine.n_ctx * 3 // 4
    middle_ids = tok(moved + middle)
    if moved and len(middle_ids) > budget * MOVED_SHARE:  # a small context: the line stays in the prefix
        prefix, middle_ids = prefix + moved, tok(middle)
    prefix_ids, suffix_ids = tok(context + prefix), tok(suffix)
    room = budget - len(head) - 3 - len(middle_ids)
    if room <= 0:
        raise BadRequestError(f"the text before the cursor is too long for the context ({engine.n_ctx} tokens)")
    suffix_ids = suffix_ids[: max(int(room * SUFFIX_SHARE), room - len(prefix_ids))]
    prefix_ids = prefix_ids[max(0, len(prefix_ids) - (room - len(suffix_ids))) :]
    if spm:
        return head + [pre, suf] + suffix_ids + [mid] + prefix_ids + middle_ids
    return head + [pre] + prefix_ids + [suf] + suffix_ids + [mid] + middle_ids


def fim_request(request: GenerationRequest) -> GenerationRequest:
    """`request` for a FIM prompt: its last token healed (see the module's docstring)."""
    return dataclasses.replace(request, token_healing=True)

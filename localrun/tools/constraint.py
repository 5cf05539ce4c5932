"""The call grammar: free text (and reasoning) until the format's trigger, then calls held
to the tools, in the model's own syntax.

One llguidance Lark grammar covers the whole answer, so the engine runs it like any
other grammar (one matcher, rolled forward token by token, also through prompt-lookup
drafts). For the Hermes format and tool_choice "auto" it reads:

    start: TEXT | lead calls
    lead[lazy]: TEXT "<tool_call>"       # text up to the first trigger, and no further
    calls: "\\n" call ("\\n</tool_call>\\n<tool_call>\\n" call)* "\\n</tool_call>"
    call: c0 | c1
    c0: "{\\"name\\": \\"get_weather\\", \\"arguments\\": " %json {...its schema...} "}"
    TEXT: /(?s:.*)/

The lazy lexeme ends at the first trigger, so free text can never hold one: once it
appears, the rest is a call of a declared tool whose arguments match its schema, and
after the last call only another call or EOS may follow. Free text costs next to
nothing: the engine checks the sampler's few best tokens against the matcher (~1 us
each) and computes a full mask only when they are all refused. Each format writes its
own `calls` rule (formats/*.py: XML parameters typed per schema, tagged JSON, harmony's
channels, which write their whole answer rule).

Choices: "required" and a named tool start the answer with the calls (after the
reasoning, where the model reasons); `parallel_tool_calls: false` drops the repetition;
"none" keeps only text that cannot contain the trigger. Formats whose calls stand at the
start of the answer (trigger "") take text there only if it does not start with "{".

Reasoning: a model with a reasoning format (reasoning.py) may open its answer with a
block (`<think>...</think>` and spacing), which may hold anything, the trigger included;
where the prompt already opened the block, the answer starts inside it and must close it.

A marker the vocabulary holds as one control token is named as that token, by id
(`<[151657]>`); control tokens never match text, so then TEXT needs no exclusion.
"""

from __future__ import annotations

import json

from ..grammar.core import Grammar, lark_spec
from .formats import BARE_FENCE, BARE_FENCE_END, BARE_SEPARATOR, CallFormat, HarmonyFormat, ToolFormat
from .lark import TEXT, WS, Literals, json_value, regex_escape
from .reasoning import THINK, ReasoningFormat
from .spec import Tool, ToolChoice

# text that does not open with a bare call: its first non-space is not "{", nor "```json" then "{"
PLAIN = "/(?s:.*)/ & ~/[ \\t\\r\\n]*(```json[ \\t\\r\\n]*)?\\{(?s:.*)/"


def call_grammar_text(
    fmt: CallFormat, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = True,
    control: dict[str, int] | None = None, reasoning: ReasoningFormat | None = None,
    reasoning_open: bool = False,
) -> str:
    """The Lark text of the constraint (see the module docstring). `control`: the format's
    markers that are single control tokens in the model's vocabulary, with their ids.
    `reasoning`: the model's reasoning format; `reasoning_open`: the prompt opened it."""
    lit = Literals(dict(control or {}))
    chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    if isinstance(fmt, HarmonyFormat):  # channels: reasoning is its analysis messages
        return "\n".join(fmt.lark_start(chosen, choice, lit)) + "\n"
    if reasoning is None and getattr(fmt, "think", False):
        reasoning = THINK
    if reasoning is not None and reasoning.name == "harmony":
        reasoning = None
    lines: list[str] = []
    if choice.mode != "none":
        lines += _json_calls(fmt, chosen, parallel, lit) if isinstance(fmt, ToolFormat) else fmt.lark_calls(
            chosen, parallel, lit)
    think, exclusion = _reasoning_rules(reasoning, reasoning_open, lit, lines)
    lines.append(_start(fmt, choice, lit, think, exclusion))
    return "\n".join(lines) + "\n"


def _json_calls(fmt: ToolFormat, chosen: list[Tool], parallel: bool, lit: Literals) -> list[str]:
    """JSON call objects (formats/json_calls.py): `calls` after the trigger, `bare` calls
    as the whole answer, `inline_calls` after Llama 3's inline opening."""
    lines = ["call: " + " | ".join(f"c{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        opening = json.dumps(f'{{"name": "{tool.name}", "{fmt.args_key}": ')
        lines.append(f'c{i}: {opening} {json_value(tool.constrained_schema())} "}}"')
    if fmt.trigger:
        more = f"({lit(fmt.separator)} call)*" if parallel else ""
        lines.append("calls: " + " ".join(item for item in (lit(fmt.head), "call", more, lit(fmt.tail)) if item))
    if fmt.bare or fmt.tag:
        more = f"({json.dumps(BARE_SEPARATOR)} call)*" if parallel else ""
        # the fence with the spacing around it is one lexeme: llguidance's lexer never ends
        # a lexeme that can still grow, and in "auto" TEXT grows over " ```json\n" up to
        # the "{", so "spacing, then a fence" would never be split out of it
        lines.append(f"bare: WS call {more} | FENCE call {more} FENCE_END\nWS: {WS}")
        lines.append(f"FENCE: /[ \\t\\r\\n]*{regex_escape(BARE_FENCE)}[ \\t\\r\\n]*/\n"
                     f"FENCE_END: /[ \\t\\r\\n]*{regex_escape(BARE_FENCE_END)}/")
    if fmt.inline:  # the call's rest, once its opening ended the text
        lines.append("rest: " + " | ".join(f"r{i}" for i in range(len(chosen))))
        for i, tool in enumerate(chosen):
            after = json.dumps(f'"{tool.name}", "{fmt.args_key}": ')
            lines.append(f'r{i}: {after} {json_value(tool.constrained_schema())} "}}"')
        more = f"({json.dumps(BARE_SEPARATOR)} call)*" if parallel else ""
        lines.append(f"inline_calls: rest {more}")
    return lines


def _reasoning_rules(reasoning: ReasoningFormat | None, opened: bool, lit: Literals,
                     lines: list[str]) -> tuple[str, str]:
    """Adds the `think` rule (a reasoning block and the spacing after it) to `lines`;
    returns how `start` uses it ("think? ", "think ", or "") and the regex that free text
    must not match (text opening with the block's start marker), if any."""
    if reasoning is None:
        return "", ""
    end = lit(reasoning.end)
    if lit.is_token(reasoning.end):
        lines.append(f"think_rest: THINK_TEXT {end}")
    else:
        lines.append(f"think_rest[lazy]: THINK_TEXT {end}")
    lines.append(f"THINK_TEXT: {TEXT}\nTHINK_WS: {WS}")
    opening = "" if opened else lit(reasoning.start) + " "
    lines.append(f"think: {opening}think_rest THINK_WS")
    if opened:
        return "think ", ""
    exclusion = "" if lit.is_token(reasoning.start) else f"/[ \\t\\r\\n]*{regex_escape(reasoning.start)}(?s:.*)/"
    return "think? ", exclusion


def _start(fmt: CallFormat, choice: ToolChoice, lit: Literals, think: str, exclusion: str) -> str:
    """The start rule: what may stand before the calls, per tool choice."""
    trigger = fmt.trigger
    trigger_is_token = lit.is_token(trigger) if trigger else False
    trig = lit(trigger) if trigger else ""
    bare = getattr(fmt, "bare", False)
    not_think = f" & ~{exclusion}" if exclusion else ""
    if choice.mode == "none":  # text only, and no trigger can occur in it
        banned = [m for m in (trigger, getattr(fmt, "tag", "")) if m and not lit.is_token(m)]
        if not banned:
            return f"start: {think}ANY\nANY: {TEXT}{not_think}"
        either = "|".join(regex_escape(m) for m in banned)
        return f"start: {think}SAFE\nSAFE: {TEXT} & ~/(?s:.*)({either})(?s:.*)/{not_think}"
    if choice.mode in ("required", "named"):  # the calls come first (after any reasoning)
        if trigger:
            return f"start: {think}{trig} calls"
        tag = getattr(fmt, "tag", "")
        return f"start: {think}({lit(tag)} bare | bare)" if tag else f"start: {think}bare"
    # auto: text, or calls after text that runs up to the trigger, or bare calls at the start
    options = ["TEXT"]
    rules = [f"TEXT: {PLAIN if bare else TEXT}{not_think}"]
    if trigger:
        options.append("lead calls")
        rules.append(f"lead: TEXT {trig}" if trigger_is_token else f"lead[lazy]: TEXT {trig}")
    if bare:
        options.append("bare")
    tag = getattr(fmt, "tag", "")
    if tag:  # Llama 3's <|python_tag|>, then bare calls
        options.append("tag_lead bare")
        rules.append(f"tag_lead: TEXT {lit(tag)}" if lit.is_token(tag) else f"tag_lead[lazy]: TEXT {lit(tag)}")
    inline = getattr(fmt, "inline", "")
    if inline:  # a call object after text: the text ends where the object opens
        options.append("inline_lead inline_calls")
        rules.append(f"inline_lead[lazy]: TEXT {json.dumps(inline)}")
    return f"start: {think}(" + " | ".join(options) + ")\n" + "\n".join(rules)


def call_grammar(
    fmt: CallFormat, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = True,
    control: dict[str, int] | None = None, reasoning: ReasoningFormat | None = None,
    reasoning_open: bool = False,
) -> Grammar:
    """The constraint as a `Grammar` (llguidance compiles it per tokenizer, bounded by
    grammar.py's limits, on its compile thread, when `request.prepare` compiles it).

    Not `Grammar.from_lark`: that probes on a byte vocabulary and caps the source at
    MAX_GRAMMAR_BYTES (128 KiB), while tools may bring MAX_TOOL_SCHEMAS_BYTES (256 KiB) of
    schemas, each already compiled on its own when it was parsed (`parse_tools`). Still
    made by `lark_spec`, which sets localrun's llguidance options (no forcing: without it
    an array of 10,000 strings of `^a{10000}$` stalled every stream of a model for up to
    104 s). The text is localrun's own (tool names are checked, schemas are JSON), so it
    is not read for a request's options lines."""
    text = call_grammar_text(fmt, tools, choice, parallel, control, reasoning, reasoning_open)
    return Grammar("lark", text, lark_spec(text, from_request=False))

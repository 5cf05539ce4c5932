"""The call grammar: free text until the format's trigger, then calls held to the tools.

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
each) and computes a full mask only when they are all refused.

Choices: "required" and a named tool start the answer with the calls (after a
`<think>` block where the template has one); `parallel_tool_calls: false` drops the
repetition; "none" keeps only text that cannot contain the trigger. Formats whose calls
stand at the start of the answer (trigger "") take text there only if it does not start
with "{". A marker the vocabulary holds as one control token is named as that token, by
id (`<[151657]>`); control tokens never match text, so then TEXT needs no exclusion.
"""

from __future__ import annotations

import json

from ..grammar.core import Grammar, lark_spec
from .formats import BARE_FENCE, BARE_FENCE_END, BARE_SEPARATOR, ToolFormat
from .spec import Tool, ToolChoice

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")
TEXT = "/(?s:.*)/"
WS = "/[ \\t\\r\\n]*/"
# text that does not open with a bare call: its first non-space is not "{", nor "```json" then "{"
PLAIN = "/(?s:.*)/ & ~/[ \\t\\r\\n]*(```json[ \\t\\r\\n]*)?\\{(?s:.*)/"


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


class _Literals:
    """Lark items for literal text; a marker the vocabulary holds as one control token
    becomes a reference to that token by id (`<[151657]>`), which only it can match."""

    def __init__(self, control: dict[str, int]) -> None:
        self.control = control

    def __call__(self, text: str) -> str:
        items: list[str] = []
        rest = text
        while rest:
            hits = [(rest.find(m), m) for m in self.control if m in rest]
            if not hits:
                items.append(json.dumps(rest))
                break
            at, marker = min(hits)
            if at:
                items.append(json.dumps(rest[:at]))
            items.append(f"<[{self.control[marker]}]>")
            rest = rest[at + len(marker):]
        return " ".join(items)


def call_grammar_text(
    fmt: ToolFormat, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = True,
    control: dict[str, int] | None = None,
) -> str:
    """The Lark text of the constraint (see the module docstring). `control`: the format's
    markers that are single control tokens in the model's vocabulary, with their ids."""
    control = dict(control or {})
    lit = _Literals(control)
    chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    lines = ["call: " + " | ".join(f"c{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        opening = json.dumps(f'{{"name": "{tool.name}", "{fmt.args_key}": ')
        lines.append(f'c{i}: {opening} %json {json.dumps(tool.constrained_schema())} "}}"')
    if fmt.trigger:
        more = f"({lit(fmt.separator)} call)*" if parallel else ""
        lines.append("calls: " + " ".join(item for item in (lit(fmt.head), "call", more, lit(fmt.tail)) if item))
    if fmt.bare:
        more = f"({json.dumps(BARE_SEPARATOR)} call)*" if parallel else ""
        # the fence with the spacing around it is one lexeme: llguidance's lexer never ends
        # a lexeme that can still grow, and in "auto" TEXT grows over " ```json\n" up to
        # the "{", so "spacing, then a fence" would never be split out of it
        lines.append(f"bare: WS call {more} | FENCE call {more} FENCE_END\nWS: {WS}")
        lines.append(f"FENCE: /[ \\t\\r\\n]*{_regex_escape(BARE_FENCE)}[ \\t\\r\\n]*/\n"
                     f"FENCE_END: /[ \\t\\r\\n]*{_regex_escape(BARE_FENCE_END)}/")
    lines.append(_start(fmt, choice, control, lit))
    return "\n".join(lines) + "\n"


def _start(fmt: ToolFormat, choice: ToolChoice, control: dict[str, int], lit: _Literals) -> str:
    """The start rule: what may stand before the calls, per tool choice."""
    trigger_is_token = fmt.trigger in control
    trig = lit(fmt.trigger) if fmt.trigger else ""
    if choice.mode == "none":  # text only, and the trigger cannot occur in it
        if not fmt.trigger or trigger_is_token:
            return f"start: ANY\nANY: {TEXT}"
        return f"start: SAFE\nSAFE: {TEXT} & ~/(?s:.*){_regex_escape(fmt.trigger)}(?s:.*)/"
    if choice.mode in ("required", "named"):  # the calls come first (after any thinking)
        think = _think_rule(control) + "\n" if fmt.think else ""
        prefix = "think? " if fmt.think else ""
        return f"{think}start: {prefix}{trig} calls" if fmt.trigger else f"{think}start: {prefix}bare"
    # auto: text, or calls after text that runs up to the trigger, or bare calls at the start
    text = PLAIN if fmt.bare else TEXT
    options = ["TEXT"]
    rules = [f"TEXT: {text}"]
    if fmt.trigger:
        options.append("lead calls")
        rules.append(f"lead: TEXT {trig}" if trigger_is_token else f"lead[lazy]: TEXT {trig}")
    if fmt.bare:
        options.append("bare")
    return "start: " + " | ".join(options) + "\n" + "\n".join(rules)


def _think_rule(control: dict[str, int]) -> str:
    """An optional reasoning block before forced calls, closed by </think> and spacing."""
    if "<think>" in control and "</think>" in control:
        return f"think: <[{control['<think>']}]> THINK_TEXT <[{control['</think>']}]> {WS}\nTHINK_TEXT: {TEXT}"
    return f"think: think_block {WS}\nthink_block[lazy]: /<think>(?s:.*)<\\/think>/"


def call_grammar(
    fmt: ToolFormat, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = True,
    control: dict[str, int] | None = None,
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
    text = call_grammar_text(fmt, tools, choice, parallel, control)
    return Grammar("lark", text, lark_spec(text, from_request=False))

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
with "{". A marker the vocabulary holds as one control token is named as that token
(`<tool_call>`); control tokens never match text, so then TEXT needs no exclusion.
"""

from __future__ import annotations

import json

from ..grammar import Grammar
from .formats import ToolFormat
from .spec import Tool, ToolChoice

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")
TEXT = "/(?s:.*)/"
WS = "/[ \\t\\r\\n]*/"
PLAIN = "/[ \\t\\r\\n]*([^{ \\t\\r\\n](?s:.*))?/"  # text whose first non-space is not "{"


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
    lines = ["%llguidance {}"]
    more = f"({lit(fmt.separator)} call)*" if parallel else ""
    lines.append("calls: " + " ".join(item for item in (lit(fmt.head), "call", more, lit(fmt.tail)) if item))
    lines.append("call: " + " | ".join(f"c{i}" for i in range(len(chosen))))
    for i, tool in enumerate(chosen):
        opening = json.dumps(f'{{"name": "{tool.name}", "{fmt.args_key}": ')
        lines.append(f'c{i}: {opening} %json {json.dumps(tool.constrained_schema())} "}}"')

    trigger_is_token = fmt.trigger in control
    think = _think_rule(control) if fmt.think else None
    if think:
        lines.append(think)
    prefix = "think? " if think else ""
    if fmt.trigger:
        trig = lit(fmt.trigger)
        if choice.mode == "none":
            safe = TEXT if trigger_is_token else f"{TEXT} & ~/(?s:.*){_regex_escape(fmt.trigger)}(?s:.*)/"
            lines.append(f"start: SAFE\nSAFE: {safe}")
        elif choice.mode == "auto":
            lead = f"lead: TEXT {trig}" if trigger_is_token else f"lead[lazy]: TEXT {trig}"
            lines.append(f"start: TEXT | lead calls\n{lead}\nTEXT: {TEXT}")
        else:
            lines.append(f"start: {prefix}{trig} calls")
    else:
        if choice.mode == "none":
            lines.append(f"start: PLAIN\nPLAIN: {PLAIN}")
        elif choice.mode == "auto":
            lines.append(f"start: PLAIN | WS calls\nPLAIN: {PLAIN}\nWS: {WS}")
        else:
            lines.append(f"start: {prefix}WS calls\nWS: {WS}")
    return "\n".join(lines) + "\n"


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
    grammar.py's limits, on its compile thread, when the engine first needs a matcher).

    Not `Grammar.from_lark`: that probes on a byte vocabulary and caps the source at
    MAX_GRAMMAR_BYTES (128 KiB), while tools may bring MAX_TOOL_SCHEMAS_BYTES (256 KiB) of
    schemas, each already compiled on its own when it was parsed (`parse_tools`)."""
    import llguidance

    text = call_grammar_text(fmt, tools, choice, parallel, control)
    return Grammar("lark", text, llguidance.LLMatcher.grammar_from_lark(text))

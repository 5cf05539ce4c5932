"""Formats whose arguments are written one parameter at a time, as XML-like tags:

    qwen3-coder  <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
                 (Qwen3-Coder, Qwen3.5); calls follow each other after a newline
    seed-oss     <seed:tool_call>\\n<function=NAME>\\n<parameter=KEY>VALUE</parameter>\\n</function>\\n</seed:tool_call>
                 (Seed-OSS): the same, with its own wrapper and no newlines around VALUE
    glm          <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>
                 (GLM-4.5/4.6; GLM-4.7 writes the same without the newlines)

A string parameter's VALUE is its raw text; any other is JSON (a number is a bare number,
an object a JSON object), as the templates print earlier calls. The grammar holds each
value to its property's schema and the parameters to the declared ones, in their order,
the required ones present; the parser turns them back into the arguments' JSON object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..lark import Literals, xml_value_rules, with_definitions
from ..spec import Tool
from .markup import MarkupParser, TriggeredCalls, XmlArguments

ANY_KEY = "/[A-Za-z0-9_.-]{1,64}/"


@dataclass(frozen=True)
class XmlFormat(TriggeredCalls):
    name: str
    trigger: str = "<tool_call>"
    newline: str = "\n"  # GLM-4.7 writes its tags with nothing between them
    close: str = "</tool_call>"
    value_newlines: bool = True  # <parameter=KEY>\nVALUE\n</parameter> (Qwen) or <parameter=KEY>VALUE</parameter>

    @property
    def markers(self) -> tuple[str, ...]:
        if self.name == "glm":
            return ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
        return (self.trigger, self.close)

    # -- grammar -------------------------------------------------------------------

    def lark_calls(self, tools: list[Tool], parallel: bool, lit: Literals) -> list[str]:
        """The `calls` rule (what follows the trigger) and its parts."""
        lines = ["call: " + " | ".join(f"c{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            lines += self._call_rules(f"c{i}", tool, lit)
        nl = json.dumps(self.newline) if self.newline else ""
        if self.name == "glm":
            more = f"({nl} {lit(self.trigger)} call)*" if parallel else ""
            lines.append(f"calls: call {more}")
        else:
            one = f'"\\n" call "\\n" {lit(self.close)}'
            more = f'("\\n" {lit(self.trigger)} {one})*' if parallel else ""
            lines.append(f"calls: {one} {more}")
        return lines

    def _call_rules(self, rule: str, tool: Tool, lit: Literals) -> list[str]:
        params = tool.parameters
        props = params.get("properties")
        required = set(params.get("required") or ())
        lines, items = [], []
        if self.name == "glm":
            nl = json.dumps(self.newline) if self.newline else ""
            key_open, key_close = lit("<arg_key>"), lit("</arg_key>")
            value_open, end = lit("<arg_value>"), "</arg_value>"
            head = f"{json.dumps(tool.name)}"
            tail = f"{nl} {lit('</tool_call>')}"

            def opening(key_item: str) -> str:
                return f"{nl} {key_open} {key_item} {key_close} {nl} {value_open}"
        else:
            head = json.dumps(f"<function={tool.name}>\n")
            nl = "\n" if self.value_newlines else ""
            end = f"{nl}</parameter>\n"
            tail = '"</function>"'

            def opening(key_item: str) -> str:
                return f'"<parameter=" {key_item} {json.dumps(">" + nl)}'
        end_item, end_is_token = lit(end), lit.is_token(end)
        if isinstance(props, dict):
            for j, (key, sub) in enumerate(props.items()):
                value = f"{rule}v{j}"
                lines += xml_value_rules(value, with_definitions(sub, params), end_item, end_is_token)
                lines.append(f"{rule}p{j}: {opening(json.dumps(key))} {value}")
                items.append(f"{rule}p{j}" + ("" if key in required else "?"))
        elif params.get("additionalProperties", True) is not False:  # any keys, any values
            lines += xml_value_rules(f"{rule}v", {}, end_item, end_is_token)
            lines.append(f"{rule}p: {opening(ANY_KEY)} {rule}v")
            items.append(f"{rule}p*")
        lines.append(f"{rule}: {head} {' '.join(items)} {tail}")
        return lines

    # -- parsing -------------------------------------------------------------------

    def parser(self, control: frozenset[str], tools: tuple[Tool, ...], new_id) -> MarkupParser:
        cls = {"glm": GlmParser, "seed-oss": SeedXmlParser}.get(self.name, QwenXmlParser)
        return cls(control, tools, new_id)


QWEN3_CODER = XmlFormat("qwen3-coder")
SEED_OSS = XmlFormat("seed-oss", trigger="<seed:tool_call>", close="</seed:tool_call>", value_newlines=False)
GLM = XmlFormat("glm")
GLM_COMPACT = XmlFormat("glm", newline="")


class _XmlParser(MarkupParser):
    """What both parsers share. STATES maps each state to the markers it waits for and the
    state each one leads to; the text of the states in BUFFERED (a name, a key, a value) is
    gathered until the marker that ends it, for `leave` to use. A call's parameters go
    through XmlArguments, which types each value by the tool's schema."""

    STATES: dict[str, dict[str, str]] = {}
    BUFFERED: tuple[str, ...] = ()

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._buf: list[str] = []
        self._key = ""
        self._args: XmlArguments | None = None

    def on_text(self, text: str) -> None:
        if self.state == "text":
            self.content.append(text)
        elif self.state in self.BUFFERED:
            self._buf.append(text)

    def on_marker(self, marker: str) -> None:
        state, text = self.state, "".join(self._buf)
        self._buf = []
        self.leave(state, marker, text)
        self.state = self.STATES[state][marker]

    def leave(self, state: str, marker: str, text: str) -> None:
        """`marker` ended `state`, which gathered `text` (if it is BUFFERED): each XML
        format says what a finished key, value or name becomes."""
        raise NotImplementedError(f"{type(self).__name__} must say what ends each state")

    def _begin(self, name: str) -> None:
        self.begin_call(name)
        self._args = XmlArguments(self, name)

    def _end(self) -> None:
        self._args.close()
        self.end_call()


def _function_states(opening: str, closing: str, value_end: str) -> dict[str, dict[str, str]]:
    """The states of <function=NAME><parameter=KEY>VALUE...</function> calls inside
    `opening`...`closing`, a VALUE ending at `value_end`."""
    return {
        "text": {opening: "call"},
        "call": {"<function=": "fname", closing: "after"},
        "fname": {">": "params"},
        "params": {"<parameter=": "pname", "</function>": "call"},
        "pname": {">": "pvalue"},
        "pvalue": {value_end: "params"},
        "after": {opening: "call"},
    }


class QwenXmlParser(_XmlParser):
    """<function=NAME> then <parameter=KEY>VALUE</parameter> per argument, VALUE between
    newlines: the parser drops the first, and the second opens the end marker."""

    STATES = _function_states("<tool_call>", "</tool_call>", "\n</parameter>")
    BUFFERED = ("fname", "pname", "pvalue")

    def leave(self, state: str, marker: str, text: str) -> None:
        if state == "fname":
            self._begin(text.strip())
        elif state == "pname":
            self._key = text.strip()
        elif state == "pvalue":
            self._args.add(self._key, text[1:] if text.startswith("\n") else text)
        elif marker == "</function>":
            self._end()


class SeedXmlParser(QwenXmlParser):
    """Qwen's tags inside <seed:tool_call>, each VALUE written right between its tags."""

    STATES = _function_states("<seed:tool_call>", "</seed:tool_call>", "</parameter>")

    def leave(self, state: str, marker: str, text: str) -> None:
        if state == "pvalue":
            self._args.add(self._key, text)
        else:
            super().leave(state, marker, text)


class GlmParser(_XmlParser):
    """NAME right after <tool_call>, ending where the first <arg_key> or the call's end
    starts; then <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> per argument."""

    STATES = {
        "text": {"<tool_call>": "gname"},
        "gname": {"<arg_key>": "key", "</tool_call>": "after"},
        "key": {"</arg_key>": "between"},
        "between": {"<arg_value>": "value"},
        "value": {"</arg_value>": "params"},
        "params": {"<arg_key>": "key", "</tool_call>": "after"},
        "after": {"<tool_call>": "gname"},
    }
    BUFFERED = ("gname", "key", "value")

    def leave(self, state: str, marker: str, text: str) -> None:
        if state == "gname":  # the name ends where its first argument or the call's end starts
            self._begin(text.strip())
        elif state == "key":
            self._key = text.strip()
        elif state == "value":
            self._args.add(self._key, text)
        if marker == "</tool_call>":
            self._end()

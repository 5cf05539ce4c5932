"""Formats that write a call as its name, then its arguments' JSON, between markers:

    kimi          <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
                  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>   (Kimi-K2)
    deepseek-v3.1 <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek-r1   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
                  (calls one per line) ...<｜tool▁calls▁end｜>
    mistral-args  [TOOL_CALLS]NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}   (Mistral Small 3.2, Devstral,
                  Magistral, Ministral-3)

(the spacing in the first lines is only for reading; the formats write none there). IDX
counts the conversation's calls; the grammar takes any small number there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..lark import Literals, json_value
from ..spec import Tool
from .markup import MarkupParser, TriggeredCalls

_MARKER = re.compile(r"<[^<>\s]{1,40}>|\[[A-Z_]{2,40}\]")


@dataclass(frozen=True)
class TaggedFormat(TriggeredCalls):
    name: str
    trigger: str  # opens the calls
    call_open: str  # opens each call
    name_prefix: str  # before the name (its text is dropped)
    args_open: str  # between the name and the arguments
    args_close: str  # after the arguments ("": they end where the next call or the answer does)
    call_close: str = ""  # after args_close
    separator: str = ""  # between two calls
    tail: str = ""  # after the last call
    indexed: bool = False  # NAME is followed by ":IDX"

    @property
    def markers(self) -> tuple[str, ...]:
        found = []
        for piece in (self.trigger, self.call_open, self.name_prefix, self.args_open, self.args_close,
                      self.call_close, self.separator, self.tail):
            found += _MARKER.findall(piece)
        return tuple(dict.fromkeys(found))

    def lark_calls(self, tools: list[Tool], parallel: bool, lit: Literals) -> list[str]:
        lines = ["call: " + " | ".join(f"c{i}" for i in range(len(tools)))]
        index = ' ":" /[0-9]{1,4}/' if self.indexed else ""
        for i, tool in enumerate(tools):
            opening = " ".join(lit(p) for p in (self.call_open, self.name_prefix) if p)
            closing = " ".join(lit(p) for p in (self.args_close, self.call_close) if p)
            lines.append(f"c{i}: {opening} {json.dumps(tool.name)}{index} {lit(self.args_open)} "
                         f"{json_value(tool.constrained_schema())} {closing}")
        sep = lit(self.separator) if self.separator else ""
        more = f"({sep} call)*" if parallel else ""
        lines.append(f"calls: call {more} {lit(self.tail) if self.tail else ''}")
        return lines

    def parser(self, control: frozenset[str], tools: tuple[Tool, ...], new_id) -> MarkupParser:
        return TaggedParser(self, control, tools, new_id)


KIMI = TaggedFormat("kimi", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>", tail="<|tool_calls_section_end|>",
                    indexed=True)
DEEPSEEK_V31 = TaggedFormat("deepseek-v3.1", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "",
                            "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", tail="<｜tool▁calls▁end｜>")
DEEPSEEK_R1 = TaggedFormat("deepseek-r1", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "function<｜tool▁sep｜>",
                           "\n```json\n", "\n```", call_close="<｜tool▁call▁end｜>", separator="\n",
                           tail="<｜tool▁calls▁end｜>")
MISTRAL_ARGS = TaggedFormat("mistral-args", "[TOOL_CALLS]", "", "", "[ARGS]", "", separator="[TOOL_CALLS]")


class TaggedParser(MarkupParser):
    """States: text (content) -> section (between calls) -> name -> args -> [close] -> section."""

    def __init__(self, fmt: TaggedFormat, *args) -> None:
        self.fmt = fmt
        section = tuple(m for m in (fmt.call_open or fmt.separator, fmt.tail) if m)
        # a marker inside the name's prefix (R1's <｜tool▁sep｜> after "function") restarts the name
        prefix_markers = tuple(_MARKER.findall(fmt.name_prefix))
        self.STATES = {
            "text": (fmt.trigger,),
            "section": section,
            "name": (fmt.args_open,) + prefix_markers,
            "args": (fmt.args_close,) if fmt.args_close else (fmt.separator,),
            "close": (fmt.call_close,),
            "after": (),
        }
        super().__init__(*args)
        self._name: list[str] = []

    def on_text(self, text: str) -> None:
        if self.state == "text":
            self.content.append(text)
        elif self.state == "name":
            self._name.append(text)
        elif self.state == "args":
            self.arguments(text)

    def on_marker(self, marker: str) -> None:
        fmt, state = self.fmt, self.state
        if state == "text":  # the trigger
            self.state = "name" if not fmt.call_open else "section"
        elif state == "section":
            self.state = "after" if marker == fmt.tail else "name"
            self._name = []
        elif state == "name":
            if marker != fmt.args_open:  # inside the prefix
                self._name = []
                return
            self.begin_call(self._clean_name("".join(self._name)))
            self.state = "args"
        elif state == "args":
            self.end_call()
            if not fmt.args_close:  # the separator: the next call's name follows
                self.state, self._name = "name", []
            else:
                self.state = "close" if fmt.call_close else "section"
        elif state == "close":
            self.state = "section"

    def at_end(self) -> None:
        if self.state == "args" and not self.fmt.args_close:
            self.end_call()

    def _clean_name(self, text: str) -> str:
        name = text.strip()
        prefix = self.fmt.name_prefix
        if prefix and not _MARKER.search(prefix) and name.startswith(prefix):
            name = name[len(prefix):]
        if self.fmt.indexed and ":" in name:
            name = name.rsplit(":", 1)[0]
        return name

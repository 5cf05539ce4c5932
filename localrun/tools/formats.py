"""How a model writes tool calls, detected once from its chat template.

A template that never reads the `tools` variable cannot show tools to the model: it has
no tool support (`detect_format` returns None). Otherwise the markers it prints for past
calls say which format the model was trained to write:

    hermes   <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>   (Qwen, Hermes)
             calls follow each other after a newline; text may come first.
    mistral  [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]
    llama3   {"name": "f", "parameters": {...}}   as the whole answer (Llama 3.1-3.3)
    generic  {"name": "f", "arguments": {...}}    as the whole answer: any other template
             that reads `tools` (the shape most models fall back to)

A triggered format writes `trigger head CALL (separator CALL)* tail`, where CALL is the
JSON object `{"name": NAME, "<args_key>": ARGUMENTS}` with the keys in that order. A
format with `bare` calls also takes CALLs, one per line, as the whole answer, optionally
in a ```json fence: small models given a Hermes template (Qwen2.5-Coder-0.5B among them)
answer that way more often than with the tags, and llama.cpp accepts it too.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

_READS_TOOLS = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str  # the text that starts the calls anywhere in the answer; "" = none
    head: str  # after the trigger, before the first call
    separator: str  # between two calls
    tail: str  # after the last call
    args_key: str = "arguments"
    bare: bool = False  # calls may also be the whole answer: bare JSON objects (BARE_* below)
    think: bool = False  # the template writes <think>...</think> before an answer

    @property
    def markers(self) -> tuple[str, ...]:
        """Marker texts that a vocabulary may hold as single control tokens (which carry no
        text when decoded, so the grammar names them as tokens and the engine tells the
        stream parser when one is produced)."""
        found = []
        for piece in (self.trigger, self.head, self.separator, self.tail):
            found += re.findall(r"<[^<>\s]{1,40}>|\[[A-Z_]{2,40}\]", piece)
        if self.think:
            found += ["<think>", "</think>"]
        return tuple(dict.fromkeys(found))


HERMES = ToolFormat("hermes", "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", bare=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "[", ", ", "]")
LLAMA3 = ToolFormat("llama3", "", "", "", "", args_key="parameters", bare=True)
GENERIC = ToolFormat("generic", "", "", "", "", bare=True)
# bare calls: one per line, the whole answer, optionally fenced as ```json ... ```
BARE_SEPARATOR = "\n"
BARE_FENCE = "```json"
BARE_FENCE_END = "```"


def supports_tools(template: str | None) -> bool:
    """The template reads the `tools` variable, so tools given to it reach the model."""
    return bool(template) and _READS_TOOLS.search(template) is not None


def detect_format(template: str | None) -> ToolFormat | None:
    """The call format the template's model writes; None when the template has no tools."""
    if not supports_tools(template):
        return None
    think = "<think>" in template
    if "<tool_call>" in template:
        fmt = HERMES
    elif "[TOOL_CALLS]" in template:
        fmt = MISTRAL
    elif "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        fmt = LLAMA3
    else:
        fmt = GENERIC
    return dataclasses.replace(fmt, think=True) if think else fmt

"""Formats whose calls are JSON objects `{"name": NAME, "<args_key>": ARGUMENTS}`:

    hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, Hermes, Granite 4)
             calls follow each other after a newline; text may come first.
    mistral  [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]        (Mistral Nemo, Small <= 3.1)
    granite  <|tool_call|>[{"name": "f", "arguments": {...}}, {...}]       (Granite 3.x)
    llama3   {"name": "f", "parameters": {...}}   as the whole answer, after text, or after
             <|python_tag|> (Llama 3.1-3.3)
    generic  {"name": "f", "arguments": {...}}    as the whole answer: any other template
             that reads `tools` (the shape most models fall back to)

A triggered format writes `trigger head CALL (separator CALL)* tail`, with the keys of
CALL in that order. A format with `bare` calls also takes CALLs, one per line, as the
whole answer, optionally in a ```json fence: small models given a Hermes template
(Qwen2.5-Coder-0.5B among them) answer that way more often than with the tags, and
llama.cpp accepts it too. `inline`: text that opens a call object after free text
(Llama 3 writes `Let me look. {"name": ...}`); `tag`: a marker after which bare calls follow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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
    inline: str = ""  # the opening of a call object that may follow free text ('{"name": ')
    tag: str = ""  # a marker that introduces bare calls anywhere (<|python_tag|>)

    @property
    def markers(self) -> tuple[str, ...]:
        """Marker texts that a vocabulary may hold as single control tokens (which carry no
        text when decoded, so the grammar names them as tokens and the engine tells the
        stream parser when one is produced)."""
        found = []
        for piece in (self.trigger, self.head, self.separator, self.tail, self.tag):
            found += re.findall(r"<[^<>\s]{1,40}>|\[[A-Z_]{2,40}\]", piece)
        if self.think:
            found += ["<think>", "</think>"]
        return tuple(dict.fromkeys(found))


HERMES = ToolFormat("hermes", "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", bare=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "[", ", ", "]")
GRANITE = ToolFormat("granite", "<|tool_call|>", "[", ", ", "]")
LLAMA3 = ToolFormat("llama3", "", "", "", "", args_key="parameters", bare=True, inline='{"name": ',
                    tag="<|python_tag|>")
GENERIC = ToolFormat("generic", "", "", "", "", bare=True)
# bare calls: one per line, the whole answer, optionally fenced as ```json ... ```
BARE_SEPARATOR = "\n"
BARE_FENCE = "```json"
BARE_FENCE_END = "```"

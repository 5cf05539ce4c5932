"""gpt-oss's harmony format: the answer is a run of messages, each a header naming its
channel (and, for a call, its recipient) and a body.

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the generation prompt ends with `<|start|>assistant`, so the first header starts at
`<|channel|>`). The analysis channel is reasoning, final is content, and a message to
`functions.NAME` is a call; one call ends the answer (`<|call|>` ends generation). The
recipient may also stand before the channel (`<|start|>assistant to=functions.NAME<|channel|>commentary json`,
as the template prints earlier calls): the parser reads both. Where no call may come (no
tools, or tool_choice "none") such a message is not a call: its body is content, as a
model without a call format writes one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..lark import TEXT, Literals, json_value, regex_escape
from ..spec import Tool, ToolChoice
from .markup import WS, MarkupParser, TriggeredCalls

START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_-]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z]+)")


@dataclass(frozen=True)
class HarmonyFormat(TriggeredCalls):
    name: str = "harmony"
    trigger: str = CHANNEL
    markers: tuple[str, ...] = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)

    def lark_start(self, tools: list[Tool], choice: ToolChoice, lit: Literals) -> list[str]:
        """The whole answer: analysis messages, then a final answer or one call."""
        if lit.is_token(END):
            body = f"ANALYSIS_TEXT {lit(END)}"
            lines = [f"ANALYSIS_TEXT: {TEXT}"]
        else:
            body = "analysis_body"
            lines = [f"analysis_body[lazy]: ANALYSIS_TEXT {lit(END)}", f"ANALYSIS_TEXT: {TEXT}"]
        lines.append(f"analysis: {lit(CHANNEL + 'analysis' + MESSAGE)} {body} {lit(START + 'assistant')}")
        lines.append(f"final: {lit(CHANNEL + 'final' + MESSAGE)} FINAL_TEXT\nFINAL_TEXT: {TEXT}")
        if lit.is_token(CHANNEL) and lit.is_token(START):
            lines.append(f"PLAIN: {TEXT}")
        else:  # text that opens no message
            opening = f"({regex_escape(CHANNEL)}|{regex_escape(START)})"
            lines.append(f"PLAIN: {TEXT} & ~/[ \\t\\r\\n]*{opening}(?s:.*)/")
        chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
        if chosen and choice.mode != "none":
            lines.append("call: " + " | ".join(f"c{i}" for i in range(len(chosen))))
            for i, tool in enumerate(chosen):
                head = lit(f"{CHANNEL}commentary to=functions.{tool.name} {CONSTRAIN}json{MESSAGE}")
                lines.append(f"c{i}: {head} {json_value(tool.constrained_schema())} {lit(CALL)}")
        answer = {"none": "final | PLAIN", "auto": "final | call | PLAIN"}.get(choice.mode, "call")
        lines.append(f"start: analysis* ({answer})")
        return lines

    def parser(self, control: frozenset[str], tools: tuple[Tool, ...], new_id, raw_reasoning: bool = False):
        return HarmonyParser(control, tools, new_id, raw_reasoning=raw_reasoning)


HARMONY = HarmonyFormat()


class HarmonyParser(MarkupParser):
    STATES = {
        "open": (CHANNEL, START),
        "header": (MESSAGE, CHANNEL, CONSTRAIN),
        "analysis": (END, CALL, RETURN),
        "final": (END, RETURN, CALL),
        "args": (CALL, END, RETURN),
        "between": (START, CHANNEL),
        "plain": (),
    }
    INITIAL = "open"
    handles_reasoning = True

    def __init__(self, control: frozenset[str], tools: tuple[Tool, ...], new_id, raw_reasoning: bool = False) -> None:
        super().__init__(control, tools, new_id)
        self.raw_reasoning = raw_reasoning  # analysis goes to content (reasoning_format "none")
        self.calls_allowed = bool(tools)  # the request's tools, none when no call may come
        self._header: list[str] = []
        self._spacing: list[str] = []  # an answer's opening spacing, until it shows what follows

    @property
    def in_reasoning(self) -> bool:
        return self.state == "analysis" and not self.raw_reasoning

    def on_text(self, text: str) -> None:
        state = self.state
        if state == "open":
            if not text.strip(WS):
                self._spacing.append(text)
                return
            self.state = "plain"
            self.content += self._spacing + [text]
            self._spacing = []
        elif state == "plain" or state == "final":
            self.content.append(text)
        elif state == "analysis":
            (self.content if self.raw_reasoning else self.reasoning).append(text)
        elif state == "header":
            self._header.append(text)
        elif state == "args":
            self.arguments(text)

    def on_marker(self, marker: str) -> None:
        state = self.state
        if state in ("open", "between"):
            self._spacing = []
            self._header = [CHANNEL] if marker == CHANNEL else []
            self.state = "header"
        elif state == "header":
            if marker != MESSAGE:
                self._header.append(" " + marker)
                return
            header = "".join(self._header)
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient and self.calls_allowed:
                self.begin_call(recipient.group(1))
                self.state = "args"
            else:
                self.state = "analysis" if channel and channel.group(1) == "analysis" else "final"
        else:  # the end of a message
            if state == "args":
                self.end_call()
            self.state = "between"


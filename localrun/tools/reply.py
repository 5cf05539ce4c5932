"""One answer, split as it streams into its parts: reasoning, content, tool calls.

    p = model_tools.output(choice, reasoning=True, tools=request.tools, prompt=prompt_tokens)
    piece = p.feed(token, text)      # ReplyPiece(reasoning, content, calls) of one token
    piece = p.finish(tail)           # the decoder's last text and whatever was held back
    p.in_reasoning, p.made_calls, p.end_of_reasoning

Reasoning comes first: a block that the answer opens (`<think>` ... `</think>`) or that
the prompt already opened; the spacing after it is dropped. What follows is the answer,
which the call format's parser splits into content and calls (stream.py for JSON call
objects, formats/*.py for the rest; harmony's parser reads reasoning from its analysis
channel itself). Content never holds markup; reasoning never reaches content, except
with `reasoning=False` (a client asked for the raw text), where it stays in content as
written. A marker the vocabulary holds as one control token comes as its token id with
no text, and counts as that marker only then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .calls import ToolCallDelta
from .formats import CallFormat, HarmonyFormat, ToolFormat
from .formats.markup import WS, partial_suffix
from .reasoning import ReasoningFormat
from .spec import Tool
from .stream import CallStream


@dataclass
class ReplyPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class _JsonAnswer:
    """CallStream (JSON call objects) behind the answer parsers' interface."""

    def __init__(self, fmt: ToolFormat, control: frozenset[str], new_id) -> None:
        self.stream = CallStream(fmt, new_id=new_id, control=control)
        self._content: list[str] = []
        self._calls: list[ToolCallDelta] = []

    def feed(self, text: str) -> None:
        self._keep(*self.stream.feed(text))

    def feed_marker(self, marker: str) -> None:
        self._keep(*self.stream.feed_marker(marker))

    def flush(self) -> None:
        self._content.append(self.stream.flush())

    def _keep(self, content: str, calls: list[ToolCallDelta]) -> None:
        self._content.append(content)
        self._calls += calls

    def take(self) -> tuple[str, str, list[ToolCallDelta]]:
        out = ("", "".join(self._content), self._calls)
        self._content, self._calls = [], []
        return out

    @property
    def started_calls(self) -> int:
        return self.stream.started_calls


class _TextAnswer:
    """An answer without calls: all of it is content."""

    started_calls = 0

    def __init__(self) -> None:
        self._content: list[str] = []

    def feed(self, text: str) -> None:
        self._content.append(text)

    def feed_marker(self, marker: str) -> None:
        """A control-token marker has no text, and without calls it starts nothing."""

    def flush(self) -> None:
        """Nothing is held back: every piece of text was content when it came."""

    def take(self) -> tuple[str, str, list[ToolCallDelta]]:
        out, self._content = "".join(self._content), []
        return "", out, []


def answer_parser(fmt: CallFormat | None, tools: tuple[Tool, ...], control: frozenset[str], new_id,
                  raw_reasoning: bool = False):
    """The parser of the answer after any reasoning block: fmt None = text only."""
    if fmt is None:
        return _TextAnswer()
    if isinstance(fmt, ToolFormat):
        return _JsonAnswer(fmt, control, new_id)
    if isinstance(fmt, HarmonyFormat):
        return fmt.parser(control, tools, new_id, raw_reasoning=raw_reasoning)
    return fmt.parser(control, tools, new_id)


class ReplyParser:
    """One answer's parser (see the module docstring). `reasoning`: the block format to
    split out (None: no block, or it stays in content); `opened`: the prompt opened it;
    `marker_ids`: control token id -> marker text, for the markers this model holds as tokens."""

    def __init__(self, answer, reasoning: ReasoningFormat | None, opened: bool,
                 marker_ids: dict[int, str], end_of_reasoning: str = "") -> None:
        self.answer = answer
        self.reasoning = reasoning
        self.marker_ids = marker_ids
        control = set(marker_ids.values())
        self._start_is_token = reasoning is not None and reasoning.start in control
        self._end_is_token = reasoning is not None and reasoning.end in control
        self.end_of_reasoning = end_of_reasoning or (reasoning.end_of_reasoning if reasoning else "")
        # "opening": the answer's first text shows whether a block opens; "reasoning"; "answer"
        self.state = "answer" if reasoning is None else "reasoning" if opened else "opening"
        self._held = ""
        self._strip = False  # drop the spacing between the reasoning block and the answer
        self._reasoning: list[str] = []

    # -- the contract ------------------------------------------------------------

    def feed(self, token: int, piece: str) -> ReplyPiece:
        if piece:
            self._text(piece)
        marker = self.marker_ids.get(token)
        if marker is not None:
            self._marker(marker)
        return self._take()

    def finish(self, piece: str) -> ReplyPiece:
        if piece:
            self._text(piece)
        held, self._held = self._held, ""
        if self.state == "reasoning":
            self._reasoning.append(held)
        elif held:  # an opening that never became a block is the answer's text
            self.state = "answer"
            self._answer(held)
        self.answer.flush()
        return self._take()

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning" or getattr(self.answer, "in_reasoning", False)

    @property
    def made_calls(self) -> bool:
        return self.answer.started_calls > 0

    def closing(self) -> str:
        """The text that ends the reasoning from here (a reasoning budget writes it): the
        model's end-of-reasoning text, less the beginning of its marker the model has
        already written (held back here until it is known whether the marker comes)."""
        if self.state == "reasoning" and self._held and self.end_of_reasoning.startswith(self._held):
            return self.end_of_reasoning[len(self._held):]
        return self.end_of_reasoning

    # -- inside ------------------------------------------------------------------

    def _text(self, text: str) -> None:
        if self.state == "opening":
            buf = self._held + text
            self._held = ""
            rest = buf.lstrip(WS)
            start = self.reasoning.start
            if not self._start_is_token and rest.startswith(start):
                self.state = "reasoning"
                self._text(rest[len(start):])
            elif not rest or (not self._start_is_token and start.startswith(rest)):
                self._held = buf  # spacing, or the start marker's beginning
            else:
                self.state = "answer"
                self._answer(buf)
        elif self.state == "reasoning":
            if self._end_is_token:
                self._reasoning.append(text)
                return
            buf = self._held + text
            self._held = ""
            end = self.reasoning.end
            at = buf.find(end)
            if at >= 0:
                self._reasoning.append(buf[:at])
                self._close_reasoning()
                self._answer(buf[at + len(end):])
                return
            keep = partial_suffix(buf, end)
            self._reasoning.append(buf[: len(buf) - keep])
            self._held = buf[len(buf) - keep:]
        else:
            self._answer(text)

    def _marker(self, marker: str) -> None:
        if self.state == "opening" and marker == self.reasoning.start:
            self._held = ""
            self.state = "reasoning"
        elif self.state == "reasoning" and marker == self.reasoning.end:
            self._reasoning.append(self._held)
            self._held = ""
            self._close_reasoning()
        elif self.state == "reasoning":
            pass  # another marker inside the reasoning: it has no text to show
        else:
            if self.state == "opening":
                self.state = "answer"
                held, self._held = self._held, ""
                self._answer(held)
            self.answer.feed_marker(marker)

    def _close_reasoning(self) -> None:
        self.state = "answer"
        self._strip = True

    def _answer(self, text: str) -> None:
        if self._strip:
            text = text.lstrip(WS)
            if not text:
                return
            self._strip = False
        self.answer.feed(text)

    def _take(self) -> ReplyPiece:
        reasoning, content, calls = self.answer.take()
        mine, self._reasoning = "".join(self._reasoning), []
        return ReplyPiece(mine + reasoning, content, calls)

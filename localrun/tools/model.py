"""One model's tool machinery: its call format, which of the format's markers its
vocabulary holds as control tokens, and its call grammars (cached per tool set), plus
the per-answer wrapper the engine feeds every generated token through.

    mt = ModelTools(backend, template)      # once per model (Engine.__init__)
    mt.format, mt.supported                 # ToolFormat | None, bool
    g = mt.grammar(tools, choice, parallel) # cached: agents resend the same tools
    out = mt.output(choice)                 # per answer (None for "none": no calls to parse)
    text, deltas = out.feed(token, piece)   # content and call deltas of one token
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..grammar.core import Grammar
from .constraint import call_grammar
from .formats import ToolFormat, detect_format
from .spec import Tool, ToolChoice, ToolsUnsupportedError
from .stream import CallStream, ToolCallDelta

# Distinct (tools, choice, parallel) grammars kept per model. An editor's agent sends one
# tool set with two or three choices; each entry holds its compiled matcher (a few MB at
# most for the largest tool sets), so a handful of clients fit.
GRAMMAR_CACHE_SIZE = 16


class ModelTools:
    def __init__(self, backend, template: str | None) -> None:
        self.format: ToolFormat | None = detect_format(template)
        self.markers: dict[str, int] = _control_markers(backend, self.format) if self.format else {}
        self._grammars: "OrderedDict[tuple, Grammar]" = OrderedDict()
        self._lock = threading.Lock()  # prepare() runs in worker threads

    @property
    def supported(self) -> bool:
        return self.format is not None

    def check(self, tools: tuple[Tool, ...]) -> None:
        if tools and self.format is None:
            raise ToolsUnsupportedError()

    def grammar(self, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool) -> Grammar:
        """The call grammar for this model (see constraint.py), built once per key."""
        self.check(tools)
        key = (tools, choice, parallel)
        with self._lock:
            hit = self._grammars.get(key)
            if hit is not None:
                self._grammars.move_to_end(key)
                return hit
        grammar = call_grammar(self.format, tools, choice, parallel, self.markers)
        with self._lock:
            grammar = self._grammars.setdefault(key, grammar)  # a racing thread's copy wins
            while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def output(self, choice: ToolChoice | None) -> "CallOutput | None":
        if self.format is None or choice is None or choice.mode == "none":
            return None
        stream = CallStream(self.format, trigger_is_token=self.format.trigger in self.markers)
        return CallOutput(stream, {i: m for m, i in self.markers.items()})


class CallOutput:
    """One answer's parser, fed token by token (a control-token marker has no text of
    its own, so it is reported to the parser by id)."""

    def __init__(self, stream: CallStream, marker_ids: dict[int, str]) -> None:
        self.stream = stream
        self.marker_ids = marker_ids

    def feed(self, token: int, piece: str) -> tuple[str, list[ToolCallDelta]]:
        text, calls = self.stream.feed(piece) if piece else ("", [])
        marker = self.marker_ids.get(token)
        if marker is not None:
            more, more_calls = self.stream.feed_marker(marker)
            text, calls = text + more, calls + more_calls
        return text, calls

    def finish(self, piece: str) -> tuple[str, list[ToolCallDelta]]:
        """The last text of the answer (the UTF-8 decoder's tail) and what was held back."""
        text, calls = self.stream.feed(piece) if piece else ("", [])
        return text + self.stream.flush(), calls

    @property
    def made_calls(self) -> bool:
        return self.stream.started_calls > 0


def _control_markers(backend, fmt: ToolFormat) -> dict[str, int]:
    """The format's markers that this vocabulary holds as one control token."""
    out = {}
    for marker in fmt.markers:
        ids = backend.tokenize(marker, add_special=False, parse_special=True)
        if len(ids) == 1 and backend.is_control(ids[0]):
            out[marker] = int(ids[0])
    return out

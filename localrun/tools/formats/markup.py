"""The streaming parser shared by the formats whose calls are framed by markers (XML tags,
<|...|> tokens): the generated text is cut at the markers the current state waits for,
and each run of text between two markers goes to the state's handler.

    class P(MarkupParser):
        STATES = {"text": ("<tool_call>",), "call": ("</tool_call>",)}
        def on_text(self, text): ...       # a run of text in self.state
        def on_marker(self, marker): ...   # a marker the state waits for; may change state

A tail of the text that could still grow into one of the state's markers is held back
until it is known (`flush()` at the answer's end lets it go as text). A marker that the
vocabulary holds as one control token has no text: it counts only when it comes as that
token (`feed_marker`), never when the same characters are written as text.

The parser collects the answer's parts as it goes: content, reasoning, and call deltas
(a call's first delta carries its id and name; later ones fragments of its arguments'
JSON text, which join to the whole arguments object).
"""

from __future__ import annotations

import json
from typing import Callable, Collection, Mapping

from ..lark import string_only
from ..spec import Tool
from ..calls import ToolCallDelta, new_call_id

WS = " \t\r\n"


class TriggeredCalls:
    """The options of json_calls.ToolFormat that the marker-framed formats (xml_calls,
    tagged_calls, harmony) never take: their calls start only at the trigger, never as bare
    JSON, after an inline opening or after a tag, and the format itself writes no <think>.
    The grammar and the stream parser read these of every format."""

    bare = False
    think = False
    inline = ""
    tag = ""


class MarkupParser:
    STATES: Mapping[str, Collection[str]] = {}  # each state's markers (xml_calls maps each to the next state)
    INITIAL = "text"

    def __init__(self, control: frozenset[str] = frozenset(), tools: tuple[Tool, ...] = (),
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.control = control
        self.schemas = {t.name: t.parameters for t in tools}
        self._new_id = new_id
        self.state = self.INITIAL
        self._held = ""
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self._deltas: dict[int, ToolCallDelta] = {}
        self.n_calls = 0  # calls finished
        self.in_call = False  # a call's first delta has gone out and its end has not come

    # -- feeding -----------------------------------------------------------------

    def feed(self, text: str) -> None:
        buf = self._held + text
        self._held = ""
        while buf:
            wanted = [m for m in self.STATES[self.state] if m not in self.control]
            at, marker = _earliest(buf, wanted)
            if marker is not None:
                if at:
                    self.on_text(buf[:at])
                buf = buf[at + len(marker):]
                self.on_marker(marker)
                continue
            keep = max((partial_suffix(buf, m) for m in wanted), default=0)
            if keep < len(buf):
                self.on_text(buf[: len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            break

    def feed_marker(self, marker: str) -> None:
        """A marker produced as a control token."""
        held, self._held = self._held, ""
        if held:
            self.on_text(held)
        if marker in self.STATES[self.state]:
            self.on_marker(marker)

    def flush(self) -> None:
        held, self._held = self._held, ""
        if held:
            self.on_text(held)
        self.at_end()

    def take(self) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning, content, deltas) gathered since the last take."""
        out = ("".join(self.reasoning), "".join(self.content), list(self._deltas.values()))
        self.reasoning, self.content, self._deltas = [], [], {}
        return out

    # -- for the formats ---------------------------------------------------------

    def on_text(self, text: str) -> None:
        """Text between markers, in the current state: each format parser says where it goes."""
        raise NotImplementedError(f"{type(self).__name__} must say where text goes")

    def on_marker(self, marker: str) -> None:
        """A marker of the format: each format parser says which state it leads to."""
        raise NotImplementedError(f"{type(self).__name__} must say what a marker does")

    def at_end(self) -> None:
        """The answer ended (a format whose last call has no closing marker ends it here)."""

    def begin_call(self, name: str) -> None:
        d = self._delta()
        d.id, d.name = self._new_id(), name
        self.in_call = True

    def arguments(self, fragment: str) -> None:
        if self.in_call and fragment:
            self._delta().arguments += fragment

    def end_call(self) -> None:
        if self.in_call:
            self.n_calls += 1
            self.in_call = False

    @property
    def started_calls(self) -> int:
        return self.n_calls + self.in_call

    def _delta(self) -> ToolCallDelta:
        d = self._deltas.get(self.n_calls)
        if d is None:
            d = self._deltas[self.n_calls] = ToolCallDelta(self.n_calls)
        return d


class XmlArguments:
    """Arguments written one parameter at a time (Qwen3-Coder's <parameter=k>, GLM's
    <arg_key>), turned into the JSON object's text as each parameter closes: a value is
    typed by the tool's schema (`xml_value`)."""

    def __init__(self, parser: MarkupParser, name: str) -> None:
        self.parser = parser
        self.schema = parser.schemas.get(name) or {}
        self.n = 0

    def add(self, key: str, raw: str) -> None:
        props = self.schema.get("properties") if isinstance(self.schema, dict) else None
        sub = props.get(key) if isinstance(props, dict) else None
        value = xml_value(raw, sub)
        self.parser.arguments(("{" if self.n == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value)
        self.n += 1

    def close(self) -> None:
        self.parser.arguments("}" if self.n else "{}")


_PY_LITERALS = {"True": True, "False": False, "None": None}


def xml_value(raw: str, schema) -> str:
    """The JSON text of a parameter written as raw text: a string parameter's text as a
    JSON string; any other as the JSON it spells (templates print Python's True/False/None
    for booleans and null, accepted too), or as a string when it spells none."""
    if string_only(schema):
        return json.dumps(raw, ensure_ascii=False)
    text = raw.strip(WS)
    if text in _PY_LITERALS:
        return json.dumps(_PY_LITERALS[text])
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return json.dumps(raw, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _earliest(buf: str, markers: list[str]) -> tuple[int, str | None]:
    best_at, best = len(buf) + 1, None
    for m in markers:
        at = buf.find(m)
        if at >= 0 and (at < best_at or (at == best_at and len(m) > len(best))):
            best_at, best = at, m
    return (best_at, best) if best is not None else (-1, None)


def partial_suffix(buf: str, word: str) -> int:
    """Length of the longest tail of buf that is a proper prefix of word."""
    for n in range(min(len(word) - 1, len(buf)), 0, -1):
        if buf.endswith(word[:n]):
            return n
    return 0

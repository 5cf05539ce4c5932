"""Generated text -> content text + tool-call deltas, as the tokens arrive.

    s = CallStream(HERMES)
    s.feed('Let me check.\\n<tool')          -> ('Let me check.\\n', [])
    s.feed('_call>\\n{"name": "get_weather"') -> ('', [])
    s.feed(', "arguments": {"city"')         -> ('', [ToolCallDelta(0, 'call_...', 'get_weather', '{"city"')])
    s.feed(': "Paris"}}\\n</tool_call>')      -> ('', [ToolCallDelta(0, None, None, ': "Paris"}')])

Content is everything before the format's trigger; the tail of the text that could still
grow into the trigger is held back (`flush()` returns it when the answer ends there).
From the trigger on, the text is markup and calls: the markup is dropped, each call's
first delta carries its id and name, and later ones carry fragments of its arguments'
JSON text as generated, which join to the whole arguments object.

The grammar (constraint.py) already guarantees the shape; the parser still reads the
call object as JSON (keys in any order, any spacing, other keys skipped), so it needs no
knowledge of how the grammar lays it out. A trigger that is a control token has no text:
the engine reports it with `feed_marker`.
"""

from __future__ import annotations

import json

from .calls import ToolCall, ToolCallDelta, collect_calls, new_call_id
from .formats.json_calls import BARE_FENCE, ToolFormat

__all__ = ["CallStream", "ToolCall", "ToolCallDelta", "collect_calls", "new_call_id"]


_WS = " \t\r\n"


class _Value:
    """Scans one JSON value's text as it arrives: where it ends, without parsing it."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.done = False

    def take(self, c: str) -> bool:
        """Feed one character; False when it is not part of the value (a scalar's end)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                self.done = self.depth == 0
            return True
        if not self.started:
            self.started = True
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth = 1
            return True
        if self.depth == 0:  # a scalar (number, true, ...): ends at a delimiter
            if c in _WS or c in ",}]":
                self.done = True
                return False
            return True
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


class CallStream:
    """One answer's parser (see the module docstring)."""

    def __init__(self, fmt: ToolFormat, trigger_is_token: bool = False, new_id=new_call_id,
                 control: frozenset[str] = frozenset()) -> None:
        self.fmt = fmt
        self.trigger_is_token = trigger_is_token or fmt.trigger in control
        # what ends content: (text, kind); "calls": markup follows, "inline": a call object opens
        # with this very text. A marker that is a control token comes through feed_marker.
        self._triggers = [(t, kind) for t, kind in ((fmt.trigger, "calls"), (fmt.tag, "calls"), (fmt.inline, "inline"))
                          if t and not (kind == "calls" and (t in control or (t == fmt.trigger and self.trigger_is_token)))]
        self._new_id = new_id
        # "start": formats with bare calls, until the answer's opening is known;
        # "text": content (looking for the trigger); "plain": content for good;
        # "between": markup before a call object; "call": inside one
        self.state = "start" if fmt.bare else "text"
        self._held = ""  # text that may still open a call (the trigger's start, spacing, a fence)
        self.n_calls = 0
        self._out: dict[int, ToolCallDelta] = {}
        # inside a call object
        self._phase = ""  # "key" | "colon" | "value" | "comma"
        self._key: list[str] | None = None
        self._key_escaped = False
        self._current_key = ""
        self._value: _Value | None = None
        self._value_text: list[str] = []
        self._name: str | None = None
        self._args_pending: list[str] = []  # arguments seen before the name
        self._saw_args = False

    # -- feeding -----------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content to show and deltas, for the next piece of generated text."""
        content = []
        i = 0
        while i < len(text):
            if self.state == "plain":
                content.append(text[i:])
                break
            if self.state == "text":
                shown, text = self._scan_text(text[i:])
                i = 0
                content.append(shown)
                continue
            if self.state == "start":
                text, i = self._opening(text[i:]), 0
                continue
            if self.state == "between":
                if text[i] == "{":
                    self._begin_call()
                i += 1
                continue
            self._call_char(text[i])
            i += 1
        return "".join(content), self._take()

    def feed_marker(self, marker: str) -> tuple[str, list[ToolCallDelta]]:
        """A marker produced as a control token (it has no text of its own)."""
        if self.state in ("text", "start") and marker in (self.fmt.trigger, self.fmt.tag):
            held, self._held = self._held, ""
            self.state = "between"
            return held, []
        return "", []  # markup between or around calls, or a marker the format ignores

    def flush(self) -> str:
        """Content still held back when the answer ends (a trigger's start that never
        completed, a blank answer's spacing, a lone fence)."""
        held, self._held = self._held, ""
        return held if self.state in ("text", "start") else ""

    # -- content -----------------------------------------------------------------

    def _opening(self, text: str) -> str:
        """State "start": hold the answer's opening until it shows whether bare calls
        follow ("{" or "```json" then "{" after any spacing) or text; returns what is
        left to read in the new state ("" while still undecided)."""
        buf = self._held + text
        rest = buf.lstrip(_WS)
        if rest.startswith(BARE_FENCE):
            after = rest[len(BARE_FENCE):].lstrip(_WS)
            if not after:
                self._held = buf
                return ""
            if after[0] == "{":
                self._held, self.state = "", "between"
                return after
        elif not rest or BARE_FENCE.startswith(rest):
            self._held = buf
            return ""
        elif rest[0] == "{":
            self._held, self.state = "", "between"
            return rest
        self._held, self.state = "", "text" if (self.fmt.trigger or self.fmt.tag or self.fmt.inline) else "plain"
        return buf

    def _scan_text(self, text: str) -> tuple[str, str]:
        """Content from `text` up to the first trigger (state -> "between" after it), holding
        back a tail that could still become one; returns (content, what is left to read)."""
        buf = self._held + text
        self._held = ""
        found = [(buf.find(t), t, kind) for t, kind in self._triggers if t in buf]
        if found:
            at, trigger, kind = min(found)
            self.state = "between"
            # the rest is markup or a call; an inline trigger is the call object's own opening
            return buf[:at], buf[at:] if kind == "inline" else buf[at + len(trigger):]
        keep = max((_partial_suffix(buf, t) for t, _ in self._triggers), default=0)
        if keep:
            self._held = buf[-keep:]
            return buf[:-keep], ""
        return buf, ""

    # -- calls -------------------------------------------------------------------

    def _begin_call(self) -> None:
        self.state = "call"
        self._phase = "key"
        self._name = None
        self._args_pending = []
        self._saw_args = False
        self._key = None

    def _call_char(self, c: str) -> None:
        if self._phase == "value":
            self._value_char(c)
            return
        if self._key is not None:  # inside a key string
            if self._key_escaped:
                self._key_escaped = False
                self._key.append(c)
            elif c == "\\":
                self._key_escaped = True
                self._key.append(c)
            elif c == '"':
                self._current_key = _json_string('"' + "".join(self._key) + '"')
                self._key = None
                self._phase = "colon"
            else:
                self._key.append(c)
            return
        if c in _WS:
            return
        if self._phase == "key" and c == '"':
            self._key = []
        elif self._phase == "colon" and c == ":":
            self._phase = "value"
            self._value = None
            self._value_text = []
        elif c == ",":
            self._phase = "key"
        elif c == "}":
            self._end_call()

    def _value_char(self, c: str) -> None:
        if self._value is None:
            if c in _WS:
                return
            self._value = _Value()
        if not self._value.take(c):  # a scalar ended at this delimiter
            self._end_value()
            self._phase = "comma"
            self._call_char(c)
            return
        self._value_text.append(c)
        if self._current_key == self.fmt.args_key:
            self._args(c)
        if self._value.done:
            self._end_value()
            self._phase = "comma"

    def _end_value(self) -> None:
        if self._current_key == "name":
            self._name = _json_string("".join(self._value_text))
            self._start_delta()
        elif self._current_key == self.fmt.args_key:
            self._saw_args = True
        self._value = None

    def _args(self, fragment: str) -> None:
        if self._name is None:
            self._args_pending.append(fragment)
            return
        self._delta().arguments += fragment

    def _start_delta(self) -> None:
        d = self._delta(first=True)
        d.arguments += "".join(self._args_pending)
        self._args_pending = []

    def _end_call(self) -> None:
        if self._name is None:  # no name: nothing a client could run; drop the object
            self.state = "between"
            return
        if not self._saw_args:
            self._delta().arguments += "{}"
        self.n_calls += 1
        self.state = "between"

    def _delta(self, first: bool = False) -> ToolCallDelta:
        index = self.n_calls
        d = self._out.get(index)
        if d is None:
            d = self._out[index] = ToolCallDelta(index)
        if first:
            d.id, d.name = self._new_id(), self._name
        return d

    def _take(self) -> list[ToolCallDelta]:
        out = list(self._out.values())
        self._out = {}
        return out

    @property
    def started_calls(self) -> int:
        """Calls whose first delta has gone out (a call cut off midway counts)."""
        return self.n_calls + (1 if self.state == "call" and self._name is not None else 0)


def _partial_suffix(buf: str, word: str) -> int:
    """Length of the longest tail of buf that is a proper prefix of word."""
    for n in range(min(len(word) - 1, len(buf)), 0, -1):
        if buf.endswith(word[:n]):
            return n
    return 0


def _json_string(literal: str) -> str:
    try:
        value = json.loads(literal)
    except (json.JSONDecodeError, RecursionError):
        return literal.strip('"')
    return value if isinstance(value, str) else str(value)

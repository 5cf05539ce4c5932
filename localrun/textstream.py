"""Token bytes -> text for a stream: never half a UTF-8 character, never a stop string.

A token may end in the middle of a multi-byte character (byte-fallback tokens of an
emoji or a CJK glyph); the incremental decoder keeps the unfinished bytes until the
character completes. The stop matcher holds back the tail of the text that could still
grow into a stop string, and cuts the text where one appears.
"""

from __future__ import annotations

import codecs


class Utf8Stream:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._dec.decode(data, final=False)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class StopMatcher:
    """Feed text pieces; get back the text that is safe to emit and whether a stop hit.

    >>> m = StopMatcher(["\\nUser:"])
    >>> m.feed("Hello\\nUs"), m.feed("er: hi")
    (('Hello', False), ('', True))
    """

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = [s for s in (stops or []) if s]
        self._held = ""
        self.matched: str | None = None  # the stop string that hit, once one has

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._held + text
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            hit, self.matched = min(found)
            self._held = ""
            return buf[:hit], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

"""An answer's thinking in the chat app: a folded, dimmed block above the answer.

Thinking can run to thousands of words and is read rarely, so it is kept cheap: plain
text in a Static (never parsed as Markdown), and while the block is folded (the
default) the text is only collected, not drawn; unfolding draws what there is, and the
block then follows the thinking as it grows."""

from __future__ import annotations

from textual.widgets import Collapsible, Static

TITLE_THINKING, TITLE_DONE, TITLE_STOPPED = "thinking…", "thought", "thought (stopped)"


class ThinkingView(Collapsible):
    def __init__(self, text: str = "", done: bool = False) -> None:
        self._body = Static("", markup=False, classes="thinking-text")
        super().__init__(self._body, title=TITLE_DONE if done else TITLE_THINKING, collapsed=True,
                         classes="thinking")
        self._parts: list[str] = [text] if text else []
        self._drawn = 0  # how many parts the Static shows

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def add(self, piece: str) -> None:
        if piece:
            self._parts.append(piece)
            if not self.collapsed:
                self._draw()

    def finish(self, stopped: bool = False) -> None:
        self.title = TITLE_STOPPED if stopped else TITLE_DONE

    def _draw(self) -> None:
        if self._drawn != len(self._parts):
            self._parts = [self.text]  # one string from now on: the next draw joins two parts
            self._drawn = 1
            self._body.update(self._parts[0])

    def on_collapsible_expanded(self, event: Collapsible.Expanded) -> None:
        self._draw()

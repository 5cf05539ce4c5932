"""The message box: several lines, Enter sends, Shift+Enter or Ctrl+J starts a new line.

Terminals without the kitty keyboard protocol send Shift+Enter as a plain Enter, so
Ctrl+J (a bare line feed, which every terminal sends) is the new-line key that always
works; the placeholder says so.
"""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "newline")


class PromptInput(TextArea):
    class Submitted(Message):
        def __init__(self, input: "PromptInput", text: str) -> None:
            super().__init__()
            self.input, self.text = input, text

        @property
        def control(self) -> "PromptInput":
            return self.input

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, tab_behavior="focus", placeholder="Message (Enter sends · Ctrl+J new line)", **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)

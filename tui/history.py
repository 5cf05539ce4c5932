"""Saved conversations (Ctrl+L, /history): Enter resumes, r renames, d deletes (asks
first), e exports to Markdown in the current folder."""

from __future__ import annotations

import time
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label

from localrun.errors import LocalrunError

from .conversations import ConversationStore, export_markdown


def when(ts: float, now: float | None = None) -> str:
    """'14:02' today, 'yesterday 09:15', else '2026-11-28'."""
    now = time.time() if now is None else now
    day, today = time.localtime(ts), time.localtime(now)
    if day[:3] == today[:3]:
        return time.strftime("%H:%M", day)
    if time.localtime(now - 86400)[:3] == day[:3]:
        return time.strftime("yesterday %H:%M", day)
    return time.strftime("%Y-%m-%d", day)


class TextPrompt(ModalScreen):
    """Ask for one line of text; dismisses with it, or None on Esc."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, question: str, value: str = "") -> None:
        super().__init__()
        self._question = question
        self._value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog small"):
            yield Label(self._question, classes="dialog-title")
            yield Input(self._value, id="answer")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)


class Conversations(ModalScreen):
    """Dismisses with the id of the conversation to resume, or None."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Close"),
        Binding("r", "rename", "Rename"),
        Binding("d", "delete", "Delete"),
        Binding("e", "export", "Export"),
    ]

    def __init__(self, store: ConversationStore, export_dir: Path | None = None) -> None:
        super().__init__()
        self.store = store
        self.export_dir = export_dir or Path.cwd()
        self._confirm_delete: int | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="history", classes="dialog"):
            yield Label("Conversations — Enter resumes · r rename · d delete · e export · Esc closes",
                        classes="dialog-title")
            yield DataTable(id="conversations", cursor_type="row", zebra_stripes=True)
            with Horizontal(classes="note-row"):
                yield Label("", id="history-note", classes="note")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Title", "Model", "Messages", "Updated")
        self.reload()
        table.focus()

    def reload(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        rows = self.store.list()
        for c in rows:
            table.add_row(c.title, c.model, str(c.n_messages), when(c.updated), key=str(c.id))
        self.note("" if rows else "No saved conversations yet: every answer is saved as it completes.")

    def note(self, text: str) -> None:
        self.query_one("#history-note", Label).update(text)

    def _selected(self) -> int | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return int(key.value)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(int(event.row_key.value))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._confirm_delete = None  # moving away cancels a pending delete

    def action_rename(self) -> None:
        cid = self._selected()
        if cid is None:
            return

        def done(title: str | None) -> None:
            if title is None:
                return
            try:
                self.store.rename(cid, title)
            except LocalrunError as exc:
                self.note(str(exc))
                return
            self.reload()

        self.app.push_screen(TextPrompt("New title:", self.store.load(cid).title), done)

    def action_delete(self) -> None:
        cid = self._selected()
        if cid is None:
            return
        if self._confirm_delete != cid:  # the first d asks, the second deletes
            self._confirm_delete = cid
            self.note(f"Delete “{self.store.load(cid).title}”? Press d again to delete.")
            return
        self._confirm_delete = None
        self.store.delete(cid)
        self.reload()
        self.note("Deleted.")

    def action_export(self) -> None:
        cid = self._selected()
        if cid is None:
            return
        conv = self.store.load(cid)
        try:
            path = export_markdown(conv, self.export_dir)
        except LocalrunError as exc:
            self.note(str(exc))
            return
        self.note(f"Exported to {path}")

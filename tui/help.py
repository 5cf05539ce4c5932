"""Slash commands and keys: one table that both the parser and the help screen read,
so the help can never list a command that does not exist."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

# (command, argument, what it does); the app has one `slash_<name>` method per entry
SLASH_COMMANDS = [
    ("/model", "[NAME|PATH]", "pick a model, or load the one named"),
    ("/settings", "", "sampler, grammar, lookup, system prompt"),
    ("/system", "[TEXT]", "set the system prompt (no text: clear it)"),
    ("/clear", "", "start a new chat (the old one stays saved)"),
    ("/save", "[TITLE]", "name this chat (every answer is already saved)"),
    ("/export", "[PATH]", "write this chat as Markdown"),
    ("/history", "", "saved conversations: resume, rename, delete, export"),
    ("/regen", "", "answer the last message again"),
    ("/copy", "", "copy the last answer to the clipboard"),
    ("/help", "", "this help"),
    ("/quit", "", "leave (also /exit, /bye)"),
]

KEYS = [
    ("Enter", "send"),
    ("Shift+Enter, Ctrl+J", "new line"),
    ("Esc", "stop the answer (keeps what was written)"),
    ("Ctrl+O", "models"),
    ("Ctrl+S", "settings"),
    ("Ctrl+N", "new chat"),
    ("Ctrl+L", "conversations"),
    ("Ctrl+R", "regenerate the last answer"),
    ("Ctrl+Y", "copy the last answer"),
    ("F1", "help"),
    ("Ctrl+Q", "quit"),
]


def parse_slash(text: str) -> tuple[str, str] | None:
    """'/system  be brief' -> ('system', 'be brief'); None when `text` is not a command.
    A known command's name is case-insensitive; '//x' sends '/x' as a message."""
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    return name.strip().lower(), arg.strip()


def help_text() -> str:
    """Two aligned columns per section: compact enough to fit one screen."""
    keys = [(k, d) for k, d in KEYS]
    commands = [(f"{c} {a}".strip(), d) for c, a, d in SLASH_COMMANDS]
    width = max(len(k) for k, _ in keys + commands) + 3
    lines = ["Keys"] + [f"  {k.ljust(width)}{d}" for k, d in keys]
    lines += ["", "Commands (type them in the message box)"] + [f"  {c.ljust(width)}{d}" for c, d in commands]
    lines += ["", "Start a message with // to send a literal /."]
    return "\n".join(lines)


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape", "dismiss(None)", "Close"), Binding("f1", "dismiss(None)", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help", classes="dialog"):
            yield Label("Help — Esc closes", classes="dialog-title")
            with VerticalScroll():
                yield Static(help_text(), markup=False)

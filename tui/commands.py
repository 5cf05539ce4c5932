"""Slash commands typed in the message box (`/model`, `/settings`, ...). A mixin of the
chat app: each `/name` calls `slash_name(arg)`; help.SLASH_COMMANDS documents them all
(a test checks that each has its handler)."""

from __future__ import annotations

import inspect
from pathlib import Path

from localrun.errors import LocalrunError

from .conversations import default_title, export_markdown
from .help import SLASH_COMMANDS
from .session import resolve


class SlashCommands:
    """Needs the app's actions (models, settings, history, help, new chat, regenerate,
    copy), its `settings`, `messages`, `title_text` and `save()`."""

    async def run_slash(self, name: str, arg: str) -> None:
        handler = getattr(self, f"slash_{name}", None)
        if handler is None:
            known = ", ".join(c for c, _, _ in SLASH_COMMANDS)
            self.notify(f"Unknown command /{name}. Commands: {known}", severity="error")
            return
        try:
            result = handler(arg)
            if inspect.isawaitable(result):
                await result
        except LocalrunError as exc:
            self.notify(str(exc), severity="error")

    def slash_model(self, arg: str) -> None:
        if not arg:
            self.action_models()
        elif not self._busy():
            self.load_model(*resolve(arg))

    def slash_settings(self, arg: str) -> None:
        self.action_settings()

    def slash_system(self, arg: str) -> None:
        self.settings.system = arg
        self.notify(f"System prompt set: {arg}" if arg else "System prompt cleared.")

    async def slash_clear(self, arg: str) -> None:
        await self.action_new_chat()

    def slash_save(self, arg: str) -> None:
        if not self.messages:
            self.notify("Nothing to save yet.")
            return
        self.title_text = arg or self.title_text or default_title(self.messages)
        self.save()
        self.notify(f"Saved as “{self.title_text}”.")

    def slash_export(self, arg: str) -> None:
        if not self.messages:
            self.notify("Nothing to export yet.")
            return
        path = export_markdown(self.conversation(), Path(arg) if arg else Path.cwd())
        self.notify(f"Exported to {path}")

    def slash_history(self, arg: str) -> None:
        self.action_history()

    def slash_regen(self, arg: str) -> None:
        self.action_regenerate()

    def slash_copy(self, arg: str) -> None:
        self.action_copy_answer()

    def slash_help(self, arg: str) -> None:
        self.action_help()

    def slash_quit(self, arg: str) -> None:
        self._cancel.set()
        self.exit()

    slash_exit = slash_bye = slash_quit  # what Ollama and llama.cpp users type

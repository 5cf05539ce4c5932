"""The sampler panel (Ctrl+S, /settings): every shared sampler parameter, answer length,
a grammar or JSON-schema file, prompt lookup, the system prompt. Apply (Ctrl+S or the
button) validates everything; a bad value keeps the panel open, marks its field and
says why on the panel's error line."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Switch, TextArea

from .settings import GRAMMAR_KINDS, PLACEHOLDERS, ChatSettings, FieldError, form_values, parse_form, sampler_fields


class SettingsPanel(ModalScreen):
    """Dismisses with the new ChatSettings, or None (Esc: nothing changes)."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Cancel"),
        Binding("ctrl+s", "apply", "Apply", priority=True),
    ]

    def __init__(self, settings: ChatSettings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        values = form_values(self.settings)
        with Vertical(id="settings", classes="dialog"):
            yield Label("Settings — Ctrl+S applies, Esc cancels", classes="dialog-title")
            with VerticalScroll(id="settings-body"):
                with Grid(id="settings-grid"):
                    fields = [(name, label) for name, label, _ in sampler_fields()]
                    for name, label in fields + [("max_tokens", "max-tokens"), ("grammar_path", "grammar file")]:
                        yield Label(label, classes="field-label")
                        yield Input(values[name], placeholder=PLACEHOLDERS.get(name, ""), id=f"f-{name}", classes="field")
                    yield Label("grammar kind", classes="field-label")
                    yield Select(
                        [("GBNF", "gbnf"), ("JSON schema", "json-schema")],
                        value=self.settings.grammar_kind if self.settings.grammar_kind in GRAMMAR_KINDS else "gbnf",
                        allow_blank=False, id="f-grammar_kind",
                    )
                    yield Label("prompt lookup", classes="field-label")
                    yield Switch(self.settings.lookup, id="f-lookup")
                yield Label("system prompt", id="system-label", classes="field-label")
                yield TextArea(self.settings.system, id="f-system")
            yield Label("", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Apply", id="apply", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self.action_apply()
        else:
            self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_apply()

    def action_apply(self) -> None:
        values = {w.id.removeprefix("f-"): w.value for w in self.query(Input)}
        kind = self.query_one("#f-grammar_kind", Select).value
        lookup = self.query_one("#f-lookup", Switch).value
        system = self.query_one("#f-system", TextArea).text
        for w in self.query(Input):
            w.remove_class("invalid")
        try:
            settings = parse_form(values, lookup, system.strip(), str(kind))
            settings.reasoning = dict(self.settings.reasoning)  # set by flags; the panel does not show them
        except FieldError as exc:
            self.query_one("#settings-error", Label).update(f"✗ {exc}")
            if exc.field:
                bad = self.query(f"#f-{exc.field}")
                if bad:
                    bad.first().add_class("invalid")
                    bad.first().focus()
            return
        self.dismiss(settings)

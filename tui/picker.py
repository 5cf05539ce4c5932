"""The model picker (Ctrl+O, /model): installed models with format, quant, size and
whether they fit this machine; Enter picks one. The listing and the fit verdict are
injected so tests and snapshots use fixed ones; by default they come from
`localrun.store.local` and `localrun.quant.selector`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from .session import resolve
from .status import human_bytes

if TYPE_CHECKING:
    from .conversations import ConversationStore

VERDICT_RANK = {"Full GPU": 3, "Partial": 2, "CPU": 1, "Won't fit": 0}


def store_models() -> list:
    from localrun.store.local import list_models

    return list_models()


def store_verdict(path: Path, n_ctx: int | None = None) -> str:
    try:
        from localrun.quant.selector import fit_verdict
    except ImportError:  # the selector is optional: without it the picker cannot judge fit
        return "?"
    return fit_verdict(path, n_ctx)


def best_model(models: Sequence, verdict: Callable[[Path], str]):
    """The model a chat with no MODEL opens: the one that runs best here (Full GPU over
    Partial over CPU), the largest among equals (more parameters, better answers); None
    when nothing fits."""
    # an unknown verdict ("?") ranks with CPU: usable, not known to be fast
    rated = [(VERDICT_RANK.get(verdict(m.path), 1), m.size_bytes, m) for m in models]
    rated = [r for r in rated if r[0] > 0]
    if not rated:
        return None
    return max(rated, key=lambda r: (r[0], r[1]))[2]


def initial_model(args, store: ConversationStore, models=store_models, verdict=store_verdict) -> tuple[Path, str] | None:
    """MODEL as given; else the model of the last conversation if still installed; else
    the best installed one; else None (the app opens the picker)."""
    if getattr(args, "model", None):
        return resolve(args.model)
    try:
        installed = models()
    except Exception:  # no store yet, or an unreadable folder: the picker will say why
        return None
    last = store.last_model()
    for m in installed:
        if m.name == last:
            return Path(m.path), m.name
    best = best_model(installed, lambda path: verdict(path, getattr(args, "ctx", None)))
    return (Path(best.path), best.name) if best is not None else None


class ModelPicker(ModalScreen):
    """Dismisses with the chosen StoredModel, or None (Esc)."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(
        self,
        current: str = "",
        models: Callable[[], list] = store_models,
        verdict: Callable[[Path], str] = store_verdict,
    ) -> None:
        super().__init__()
        self._current = current
        self._list_models = models
        self._verdict = verdict
        self.models: list = []

    def compose(self) -> ComposeResult:
        with Vertical(id="picker", classes="dialog"):
            yield Label("Models — Enter loads, Esc closes", classes="dialog-title")
            yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
            yield Label("Scanning installed models…", id="picker-note", classes="note")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Model", "Format", "Quant", "Size", "Fits")
        self._scan()

    @work(thread=True, exclusive=True)
    def _scan(self) -> None:
        # a folder walk and one GGUF header read per model: off the event loop
        try:
            models = sorted(self._list_models(), key=lambda m: m.name.lower())
            rows = [(m, self._verdict(m.path)) for m in models]
            error = ""
        except Exception as exc:  # the store is optional here: say why, keep the chat usable
            rows, error = [], f"cannot list models: {exc}"
        self.app.call_from_thread(self._show, rows, error)

    def _show(self, rows: list, error: str) -> None:
        table = self.query_one(DataTable)
        note = self.query_one("#picker-note", Label)
        self.models = [m for m, _ in rows]
        for m, fit in rows:
            marker = "● " if m.name == self._current else "  "
            table.add_row(marker + m.name, m.format, m.quant, human_bytes(m.size_bytes), fit, key=m.name)
        if error:
            note.update(error)
        elif not rows:
            note.update("No models installed. Run `localrun chat PATH` with a .gguf file or an MLX folder.")
        else:
            note.update(f"{len(rows)} model(s) — /model PATH opens any file")
            table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        chosen = next((m for m in self.models if m.name == event.row_key.value), None)
        self.dismiss(chosen)

"""The status bar: what the engine is doing, live.

    SmolLM2:Q4_1 │ TTFT 41 ms │ 88.3 tok/s │ draft 62% │ ctx 212/4096 │ mem 310 MB

The text is built by `status_text` from plain values so it is tested without a
screen; the widget only holds the latest values and refreshes memory once a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from textual.widgets import Static

from localrun.engine import Timings


def process_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KB'; binary units, one decimal below 10, none above."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" or n >= 10 else f"{n:.1f} {unit}"


@dataclass
class StatusValues:
    model: str = ""
    quant: str = ""
    state: str = ""  # "loading …", "generating", "stopped", "" when idle
    timings: Timings | None = None
    lookup: bool = False
    ctx_used: int = 0
    n_ctx: int = 0
    rss: int = 0


def status_text(v: StatusValues) -> str:
    parts: list[str] = []
    if v.model:
        # "org/repo:QUANT" shows as "repo:QUANT": the line is short and the numbers matter more
        name = v.model.rsplit("/", 1)[-1]
        parts.append(f"{name}:{v.quant}" if v.quant and not name.lower().endswith(v.quant.lower()) else name)
    else:
        parts.append("no model (Ctrl+O)")
    if v.state:
        parts.append(v.state)
    t = v.timings
    if t is not None and t.generated_tokens:
        parts.append(f"TTFT {t.ttft_ms:.0f} ms")
        parts.append(f"{t.decode_tps:.1f} tok/s" if t.decode_tokens else "… tok/s")
        if v.lookup and t.drafted:
            parts.append(f"draft {100 * t.acceptance:.0f}%")
    if v.n_ctx:
        parts.append(f"ctx {v.ctx_used}/{v.n_ctx}")
    if v.rss:
        parts.append(f"mem {human_bytes(v.rss)}")
    return " │ ".join(parts)


class StatusBar(Static):
    """One line at the bottom; `update_values(**changes)` from the app, memory on a timer."""

    def __init__(self, rss: Callable[[], int] = process_rss, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.values = StatusValues()
        self._rss = rss

    def on_mount(self) -> None:
        self._tick()
        self.set_interval(1.0, self._tick)

    def _tick(self) -> None:
        self.values.rss = self._rss()
        self._show()

    def update_values(self, **changes) -> None:
        for k, v in changes.items():
            setattr(self.values, k, v)
        self._show()

    def _show(self) -> None:
        # a repaint, not a layout: the stylesheet fixes the line's size (#status), and a
        # layout of the whole screen on every frame and every tick cost the UI thread
        # ~3 ms each while an answer decodes
        self.update(status_text(self.values), layout=False)

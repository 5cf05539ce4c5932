"""Snapshots (pytest-textual-snapshot) of the chat's main screens: the empty chat, the
model picker, the settings panel and the help. None of them shows model output, and
memory and the model list are fixed, so they are the same on every machine.
Update after an intended change: pytest tests/test_tui_snapshots.py --snapshot-update"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

pytest.importorskip("pytest_textual_snapshot")

from localrun.cli import build_parser  # noqa: E402
from localrun.store.local import StoredModel  # noqa: E402
from localrun.tui.app import ChatApp  # noqa: E402
from localrun.tui.conversations import ConversationStore  # noqa: E402
from localrun.tui.session import ChatSession  # noqa: E402
from localrun.tui.settings import settings_from_args  # noqa: E402

SIZE = (100, 30)
MODELS = [
    StoredModel("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1", Path("/m/smol.gguf"), "gguf", "Q4_1", 98362432, "localrun"),
    StoredModel("google/gemma-3-270m-GGUF:Q4_K_M", Path("/m/gemma.gguf"), "gguf", "Q4_K_M", 253113024, "hf-cache"),
    StoredModel("mlx-community/Qwen3-4B-4bit", Path("/m/qwen"), "mlx", "4bit", 2263131136, "localrun"),
    StoredModel("unsloth/Llama-3.3-70B-Instruct-GGUF:Q8_0", Path("/m/llama.gguf"), "gguf", "Q8_0", 74975064064, "lmstudio"),
]
VERDICTS = {"/m/smol.gguf": "Full GPU", "/m/gemma.gguf": "Full GPU", "/m/qwen": "Partial", "/m/llama.gguf": "Won't fit"}


@pytest.fixture
def app(tmp_path, monkeypatch, smollm2_gguf):
    monkeypatch.setenv("LOCALRUN_DATA", str(tmp_path))
    args = build_parser().parse_args(["chat", str(smollm2_gguf), "--temperature", "0"])
    app = ChatApp(
        ChatSession(n_ctx=512, threads=2),
        settings_from_args(args),
        ConversationStore.open(),
        (smollm2_gguf, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"),
        models=lambda: list(MODELS),
        verdict=lambda path: VERDICTS[str(path)],
        rss=lambda: 300 << 20,
    )
    yield app
    app.session.close()
    app.store.close()


async def until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def steady(pilot) -> None:
    """Stop cursors blinking: a screenshot must not depend on when in the blink it falls."""
    for screen in pilot.app.screen_stack:
        for widget in screen.query("Input, TextArea"):
            widget.cursor_blink = False
    await pilot.pause()


async def wait_loaded(pilot) -> None:
    await until(lambda: not pilot.app.loading and pilot.app.session.engine is not None)
    await steady(pilot)


def test_empty_chat(app, snap_compare):
    assert snap_compare(app, terminal_size=SIZE, run_before=wait_loaded)


def test_model_picker(app, snap_compare):
    async def open_picker(pilot):
        await wait_loaded(pilot)
        await pilot.press("ctrl+o")
        await until(lambda: pilot.app.screen.models)
        await steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=open_picker)


def test_settings_panel(app, snap_compare):
    async def open_settings(pilot):
        await wait_loaded(pilot)
        await pilot.press("ctrl+s")
        await steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=open_settings)


def test_settings_panel_rejects_a_value(app, snap_compare):
    async def bad_value(pilot):
        await wait_loaded(pilot)
        await pilot.press("ctrl+s")
        pilot.app.screen.query_one("#f-temperature").value = "-2"
        await pilot.press("ctrl+s")
        await steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=bad_value)


def test_help(app, snap_compare):
    async def open_help(pilot):
        await wait_loaded(pilot)
        await pilot.press("f1")
        await steady(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=open_help)

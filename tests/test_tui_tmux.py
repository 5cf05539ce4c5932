"""End to end: the real chat command in a real terminal (tmux), driven as a user would:
keys in, screen text out. It runs `python -m localrun chat` (what `localrun chat`
runs) with a private store and data folder. Also: its one-line errors, and the line
REPL it falls back to when piped."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"


@pytest.fixture
def env(tmp_path, smollm2_gguf):
    folder = tmp_path / "models" / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF"
    folder.mkdir(parents=True)
    (folder / smollm2_gguf.name).symlink_to(smollm2_gguf)
    values = {"LOCALRUN_MODELS": tmp_path / "models", "HF_HUB_CACHE": tmp_path / "hf",
              "LOCALRUN_LMSTUDIO_MODELS": tmp_path / "lms", "LOCALRUN_DATA": tmp_path / "data"}
    for v in values.values():
        v.mkdir(exist_ok=True)
    return {k: str(v) for k, v in values.items()}


class Tmux:
    def __init__(self, command: str, env: dict[str, str], cwd: str) -> None:
        self.name = f"localrun-test-{uuid.uuid4().hex[:8]}"
        flags = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "100", "-y", "30", "-c", cwd,
                        *flags, command], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def screen(self) -> str:
        out = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True)
        return out.stdout

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared on screen; last screen:\n{self.screen()}")

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def saved_answers(data_dir: str) -> list[str]:
    path = os.path.join(data_dir, "conversations.db")
    if not os.path.exists(path):
        return []
    with sqlite3.connect(path) as db:
        return [r[0] for r in db.execute("SELECT content FROM messages WHERE role = 'assistant'")]


def test_chat_in_a_real_terminal(env, tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = (f"{sys.executable} -m localrun chat {MODEL} --ctx 512 --max-tokens 8 --temperature 0 --threads 2;"
               " echo EXIT=$?; sleep 30")
    term = Tmux(command, env, repo)
    try:
        term.wait_for("ctx 0/512")  # loaded: the status line shows the empty context
        screen = term.screen()
        assert "SmolLM2-135M-Instruct-GGUF:Q4_1" in screen and "Enter sends" in screen

        term.keys("Name three colors.", "Enter")
        term.wait_for("Name three colors.")
        deadline = time.monotonic() + 60
        while not saved_answers(env["LOCALRUN_DATA"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        answers = saved_answers(env["LOCALRUN_DATA"])
        assert answers and answers[0].strip(), "the answer was not saved"
        first_line = answers[0].strip().splitlines()[0].strip()
        screen = term.wait_for(first_line[:20])  # the answer is on screen
        assert "tok/s" in screen and "TTFT" in screen

        term.keys("first line", "C-j", "second line")  # Ctrl+J: a new line, not a send
        screen = term.wait_for("second line")
        lines = [line.strip("│ ") for line in screen.splitlines()]
        assert lines.index("second line") == lines.index("first line") + 1
        assert len(saved_answers(env["LOCALRUN_DATA"])) == 1  # nothing was sent

        term.keys("F1")
        term.wait_for("Help — Esc closes")
        term.keys("Escape")
        term.keys("C-q")
        assert "EXIT=0" in term.wait_for("EXIT=", timeout=20)
    finally:
        term.kill()


def test_missing_model_is_one_error_line(env):
    proc = subprocess.run([sys.executable, "-m", "localrun", "chat", "no/such-model:Q4_K_M"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no/such-model" in lines[0]


def test_piped_chat_falls_back_to_the_line_repl(env, smollm2_gguf):
    """Not a terminal (a script, a pipe): the plain REPL answers instead of the app."""
    proc = subprocess.run([sys.executable, "-m", "localrun", "chat", str(smollm2_gguf), "--max-tokens", "6",
                           "--temperature", "0", "--ctx", "256", "--threads", "2"],
                          input="Name a color.\n/exit\n", env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "\x1b[" not in proc.stdout  # an answer, and no screen drawing

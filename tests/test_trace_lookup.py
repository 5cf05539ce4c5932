"""scripts/lookup/trace_lookup.py, run as a user runs it: the real engine, a real test model."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.research
ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.lookup.trace_lookup", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_trace_shows_each_decision_of_a_copying_answer_and_the_step_that_verified_it(smollm2_gguf):
    done = _run("--model", str(smollm2_gguf), "--task", "edit", "--rounds", "1", "--max-tokens", "24", "--text",
                "--only")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert re.search(r"round 1 edit +lookup +[\d.]+ tok/s", out)
    trace = out.split("edit, round 1, with lookup")[1].splitlines()
    decisions = [line for line in trace if line.lstrip().startswith("pos ")]
    steps = [line for line in trace if line.lstrip().startswith("step ")]
    assert decisions and steps  # the answer copies the prompt's function: matches, and steps for them
    # a band and its rate, or "-" where nothing but the template's turn marks followed the match
    assert all(re.search(r"match +\d+ +band (\d +rate [01]\.\d{3}|- +rate -) +draft +\d+ +\| price 2:", d)
               for d in decisions)
    assert any(re.search(r"band \d +rate", d) for d in decisions)
    drafted = [s for s in steps if not s.lstrip().startswith("step  1 ")]
    assert drafted, "a copied code edit drafts"
    assert all(re.search(r"kept \d+/\d+$", s) for s in drafted)  # every wide step got its verdict
    texts = [re.fullmatch(r" *tail (.+)  draft (.+)", line) for line in trace if line.lstrip().startswith("tail ")]
    assert len(texts) == len(decisions) and all(texts)  # --text: each decision's tail and draft as text
    shown = [ast.literal_eval(t[1]) + ast.literal_eval(t[2]) for t in texts]
    # The function the answer copies. How far each draft reaches depends on the step prices this
    # machine measured, so the name may be split between a tail and its draft, or a draft may leap
    # past it; the tail (12 tokens) plus its draft around "def" always shows "def merge".
    assert any("def merge" in s for s in shown), shown


def test_trace_refuses_a_bad_argument_in_one_line():
    done = _run("--rounds", "0")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith("error: ")

"""scripts/lookup/replay_lookup.py's drift replay and scripts/lookup/record_drift.py, run
as a user runs them (the recorder on the real SmolLM2; the replay on a small table written
here, since measuring the real ones takes minutes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.lookup.lookup_tasks import TASKS
from scripts.lookup.record_drift import windows
from scripts.lookup.replay_lookup import Drift

pytestmark = pytest.mark.research
ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"scripts.lookup.{script}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_drift_is_each_step_over_its_width_at_the_recorded_median():
    # one-row steps of 10 ms, 20-row steps of 80 ms; the machine halves its speed at 1 s
    steps = [(t / 10, rows, ms * (2 if t >= 10 else 1)) for t, (rows, ms) in enumerate([(1, 10.0), (20, 80.0)] * 10)]
    drift = Drift(steps)
    early, late = drift.factor(500.0), drift.factor(1500.0)
    assert late == 2 * early
    assert drift.factor(500.0 + drift.span_ms) == early  # the record repeats past its end
    assert drift.starts(4) == [0.0, drift.span_ms / 4, drift.span_ms / 2, drift.span_ms * 3 / 4]


def _copying_session(tmp_path: Path) -> Path:
    """A --load file: one model whose every answer copies its prompt's 60 tokens twice,
    and one cost table (ratios by width) for every task."""
    prompt = list(range(100, 160))
    answers = {name: (prompt, (prompt * 3)[:128]) for name in TASKS}
    ratios = {1: 1.0, 2: 1.8, 4: 2.8, 8: 4.4, 16: 7.0, 33: 13.0, 49: 19.0}
    path = tmp_path / "session.json"
    path.write_text(json.dumps({"tiny": {"answers": answers, "cost": ratios}}))
    return path


def test_replay_under_a_recorded_drift_reports_every_start(tmp_path):
    session = _copying_session(tmp_path)
    record = tmp_path / "drift.json"
    steps = [(t / 20, rows, ms * (1.5 if (t // 40) % 2 else 1.0))
             for t, (rows, ms) in enumerate([(1, 10.0), (1, 10.0), (20, 90.0), (49, 190.0)] * 50)]
    record.write_text(json.dumps({"model": "tiny", "steps": steps}))
    quiet = _run("replay_lookup", "--load", str(session))
    drifting = _run("replay_lookup", "--load", str(session), "--drift", str(record), "--drift-starts", "3")
    assert quiet.returncode == 0 and drifting.returncode == 0, quiet.stderr[-2000:] + drifting.stderr[-2000:]
    header = re.compile(r"LU/simple +lowest\n")
    assert not header.search(quiet.stdout) and header.search(drifting.stdout) and "from 3 starts" in drifting.stdout
    row = re.search(r"\n  rename +([\d.]+)x +(\d+)/(\d+) +([\d.]+)x.* ([\d.]+) +([\d.]+)\n", drifting.stdout)
    assert row, drifting.stdout
    x, accepted, drafted, simple, vs_simple, lowest = row.groups()
    assert int(accepted) > 0 and int(drafted) <= 3 * 128  # three replays' drafts, summed
    assert float(x) > 1.0  # a copying answer pays, whatever the drift made the controller believe
    assert float(lowest) <= float(vs_simple)


def test_replay_refuses_a_missing_or_foreign_drift_record_in_one_line(tmp_path):
    session = _copying_session(tmp_path)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"steps": [[0.0, 20, 90.0]]}))  # no one-row step to measure speed by
    for record in (tmp_path / "none.json", foreign, session):
        done = _run("replay_lookup", "--load", str(session), "--drift", str(record))
        assert done.returncode == 2
        assert done.stderr.strip().count("\n") == 0 and "scripts.lookup.record_drift" in done.stderr


def test_record_drift_writes_its_steps_and_prints_each_window(smollm2_gguf, tmp_path):
    out = tmp_path / "drift.json"
    done = _run("record_drift", "--model", str(smollm2_gguf), "--seconds", "3", "--window", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    steps = json.loads(out.read_text())["steps"]
    assert {rows for _, rows, _ in steps} >= {1, 20, 49} and all(ms > 0 for _, _, ms in steps)
    assert len(Drift(steps).factors) == len(steps)
    printed = [line for line in done.stdout.splitlines() if "one-row" in line and " ms " in line]
    # each window shows the widths its recorded steps held (how many fit in a second is the
    # machine's speed: a cycle of CYCLE's widths took 1.7 s on a slow CI machine)
    assert printed == windows(steps, 1.0)
    assert any(re.search(r"49: *[\d.]+", w) for w in printed)
    assert not list(tmp_path.glob("*.partial"))


def test_record_drift_refuses_a_bad_argument_in_one_line(tmp_path):
    done = _run("record_drift", "--seconds", "0", "--out", str(tmp_path / "d.json"))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith("error: ")


def test_replayed_drafts_stop_before_the_recorded_turn_marks(tmp_path):
    """An answer that echoes the question and goes on in its own words: the engine's drafts
    end where the question does, before the turn mark; a file without recorded marks
    replays drafts through it."""
    question, mark = list(range(100, 160)), 999
    answers = {name: (question + [mark], question + list(range(500, 568))) for name in TASKS}
    ratios = {1: 1.0, 2: 1.8, 4: 2.8, 8: 4.4, 16: 7.0, 33: 13.0, 49: 19.0}
    kept_drafted = {}
    for marks in ([], [mark]):
        path = tmp_path / f"marks{len(marks)}.json"
        path.write_text(json.dumps({"tiny": {"answers": answers, "control": marks, "cost": ratios}}))
        done = _run("replay_lookup", "--load", str(path))
        assert done.returncode == 0, done.stderr[-2000:]
        row = re.search(r"\n  rename +[\d.]+x +(\d+)/(\d+) ", done.stdout)
        assert row, done.stdout
        kept_drafted[len(marks)] = tuple(map(int, row.groups()))
    kept, drafted = kept_drafted[1]
    assert kept == drafted > 0  # every draft ended with the question
    kept, drafted = kept_drafted[0]
    assert drafted > kept  # the mark was drafted, and rejected

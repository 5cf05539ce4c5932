"""The suite checks what it says it checks: no assert that always passes, no wall-clock
threshold that a busy CI machine can fail (outside the named product promises below), and
no skip that CI accepts unless it is for hardware this machine lacks (tests/conftest.py).

The first two are static checks over tests/*.py with `ast`:

- an assert whose expression is a constant (`assert 1`, `assert "text"`), a non-empty tuple
  (`assert (x, "message")`: always true), or holds `... or True`;
- a comparison inside an assert where one side is a clock reading (time.time(),
  time.perf_counter(), time.monotonic(), their _ns forms) or a value made from one: a name
  assigned from such an expression (`elapsed = time.monotonic() - t0`), a list appended
  with one (`health.append(...)`, then `max(health)`), a dict whose items hold one, the
  loop variables over those, or a call to a helper of the file that returns one.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# "file::function" -> why a wall-clock bound is right there. A bound here is a promise the
# product makes (an answer within seconds under attack, a slot freed at once), set with a
# wide margin over what a loaded 2-core machine takes; anything else is checked by identity,
# call counts or synthetic inputs instead. An entry that matches nothing fails the check.
ALLOWED_TIME_THRESHOLDS = {
    "test_hub.py::test_a_stall_times_out_and_resumes":
        "a download stalled for 20 s resumes after the 0.5 s read timeout: under 10 s tells a resume from"
        " waiting out the stall",
    "test_rpc_serve.py::test_serve_gives_up_on_a_worker_that_hangs":
        "a stopped RPC worker ends the stream after --rpc-timeout 4 s instead of hanging: under 60 s",
    "test_server_anthropic.py::test_hang_up_cancels_the_job":
        "a hung-up stream frees its slot: polled up to 10 s (the job asked for 32000 tokens)",
    "test_server_anthropic.py::test_hostile_bodies_are_refused_while_a_victim_streams":
        "a hostile body is refused within 3 s while a victim streams (the attacks took minutes)",
    "test_server_api.py::test_keep_alive_zero_unloads_and_negative_keeps":
        "a model with keep_alive 1 s is unloaded by itself: polled up to 10 s",
    "test_server_attacks.py::under_attack":
        "the attack is answered within ATTACK_WAIT_S (10 s; the bugs took minutes) and /health within"
        " HEALTH_WAIT_S (1 s) throughout: the README's promise that one request never starves the server",
    "test_server_attacks.py::_wait_for":
        "the signal tests' wait for a state (STOP_WAIT_S, 60 s): only so that a server that never gets"
        " there cannot hang the run, not a speed claim",
    "test_server_attacks.py::test_a_slow_tokenize_over_rpc_fails_its_request_and_keeps_the_child":
        "a tokenize side call over RPC gives up after its 0.5 s limit: under 1.2 s shows the limit works",
    "test_server_fuzz.py::_ask":
        "every fuzzed request is answered within ANSWER_WAIT_S (10 s) while a victim streams",
    "test_server_responses.py::test_hostile_request_is_refused_while_a_victim_streams":
        "a hostile /v1/responses request is refused within ATTACK_WAIT_S (10 s) while a victim streams",
    "test_server_robust.py::test_disconnect_during_decode_frees_the_slot":
        "the server's slot-release bound: a client that hangs up mid-decode frees its slot within 0.5 s",
    "test_server_robust.py::test_disconnect_during_prefill_frees_the_slot":
        "the server's slot-release bound: a client that hangs up mid-prefill frees its slot within 0.5 s",
    "test_server_robust.py::test_disconnect_while_queued_and_full_queue":
        "the server's slot-release bound: a queued request whose client hangs up leaves the queue within 0.5 s",
    "test_tui_app.py::test_escape_stops_mid_answer_and_ui_stays_responsive":
        "Esc stops an answer within 5 s while the model writes (it asked for 400 tokens)",
    "test_tui_snapshots.py::until":
        "the snapshot helper's wait for the app to settle: a 60 s timeout, not a speed claim",
}

CLOCKS = {"time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "monotonic_ns"}
AGGREGATES = {"max", "min", "sum", "abs", "round", "float", "sorted"}  # of times: a time
TIME = "time"  # the shape of a clock value; a container of them is ("seq", shape), a tuple ("tuple", [shapes])


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    function: str  # the top-level function (or Class.method) the assert is in; "" at module level
    kind: str  # "constant assert" or "time threshold"
    source: str  # the assert's first line

    @property
    def key(self) -> str:
        return f"{self.file}::{self.function}"

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.function or 'module'}): {self.kind}: {self.source}"


def _scopes(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(name, node) for each top-level function and class method; nested functions stay in
    theirs (a closure shares its names); module-level statements are the scope ""."""
    out: list[tuple[str, ast.AST]] = []
    module = ast.Module(body=[], type_ignores=[])
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((f"{node.name}.{item.name}", item))
        else:
            module.body.append(node)
    return [("", module), *out]


class _Shapes:
    """Which values of one scope come from a clock, found by repeating until nothing changes."""

    def __init__(self, modules: set[str], clocks: set[str], timed_calls: set[str]) -> None:
        self.modules, self.clocks, self.timed_calls = modules, clocks, timed_calls
        self.names: dict[str, object] = {}

    def is_clock(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            return f.value.id in self.modules and f.attr in CLOCKS
        return isinstance(f, ast.Name) and f.id in self.clocks

    def of(self, node: ast.AST | None):
        """TIME, ("seq", shape), ("tuple", [shape, ...]) or None (nothing to do with a clock)."""
        if node is None:
            return None
        if self.is_clock(node):
            return TIME
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.BinOp):
            return TIME if TIME in (self.of(node.left), self.of(node.right)) else None
        if isinstance(node, ast.UnaryOp):
            return self.of(node.operand)
        if isinstance(node, (ast.Tuple, ast.List)):
            shapes = [self.of(e) for e in node.elts]
            return ("tuple", shapes) if any(shapes) else None
        if isinstance(node, ast.Subscript):
            return _element(self.of(node.value))
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in self.timed_calls:
                return TIME
            if isinstance(f, ast.Name) and f.id in AGGREGATES and node.args:
                shapes = [self.of(a) for a in node.args]
                if TIME in shapes:
                    return TIME
                if len(node.args) == 1 and shapes[0] is not None:  # max(times), sorted(times)
                    inner = _element(shapes[0])
                    return ("seq", inner) if f.id == "sorted" and inner else inner
            if isinstance(f, ast.Attribute) and f.attr in ("items", "values"):
                inner = _element(self.of(f.value))
                if inner is not None:
                    return ("seq", ("tuple", [None, inner]) if f.attr == "items" else inner)
        return None

    def bind(self, target: ast.AST, shape) -> None:
        if shape is None:
            return
        if isinstance(target, ast.Name):
            self.names[target.id] = shape
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(shape, tuple) and shape[0] == "tuple":
            for t, s in zip(target.elts, shape[1]):
                self.bind(t, s)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            self.names[target.value.id] = ("seq", shape)  # out[k] = time
        elif isinstance(target, ast.Starred):
            self.bind(target.value, ("seq", shape))

    def learn(self, scope: ast.AST) -> None:
        for _ in range(8):
            before = dict(self.names)
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        self.bind(target, self.of(node.value))
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
                    self.bind(node.target, self.of(node.value))
                elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                    self.bind(node.target, _element(self.of(node.iter)))
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in ("append", "add", "insert") and node.args):
                    self.bind(ast.Subscript(value=node.func.value, slice=ast.Constant(0)), self.of(node.args[-1]))
            if self.names == before:
                return

    def returns_time(self, scope: ast.AST) -> bool:
        return any(isinstance(n, ast.Return) and self.of(n.value) == TIME for n in ast.walk(scope))


def _element(shape):
    if isinstance(shape, tuple) and shape[0] == "seq":
        return shape[1]
    return None


def _always_true(test: ast.AST) -> bool:
    if isinstance(test, ast.Constant):
        return True  # `assert 0` never passes, `assert 1` always: neither checks anything
    if isinstance(test, ast.Tuple) and test.elts:
        return True
    return any(isinstance(n, ast.BoolOp) and isinstance(n.op, ast.Or)
               and any(isinstance(v, ast.Constant) and v.value for v in n.values) for n in ast.walk(test))


def check_source(source: str, file: str = "<test>") -> list[Finding]:
    """The constant asserts and the wall-clock thresholds in one test file's source."""
    tree = ast.parse(source)
    modules, clocks = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "time"}
        elif isinstance(node, ast.ImportFrom) and node.module == "time":
            clocks |= {a.asname or a.name for a in node.names if a.name in CLOCKS}
    scopes = _scopes(tree)
    timed_calls: set[str] = set()  # the file's helpers that return a clock value
    while True:
        shapes = {}
        for name, scope in scopes:
            shapes[name] = _Shapes(modules, clocks, timed_calls)
            shapes[name].learn(scope)
        more = {name for name, scope in scopes if name and "." not in name and shapes[name].returns_time(scope)}
        if more <= timed_calls:
            break
        timed_calls |= more
    findings, lines = [], source.splitlines()
    for name, scope in scopes:
        for node in ast.walk(scope):
            if not isinstance(node, ast.Assert):
                continue
            if _always_true(node.test):
                kind = "constant assert"
            elif any(isinstance(c, ast.Compare) and TIME in map(shapes[name].of, [c.left, *c.comparators])
                     for c in ast.walk(node.test)):
                kind = "time threshold"
            else:
                continue
            findings.append(Finding(file, node.lineno, name, kind, lines[node.lineno - 1].strip()))
    return sorted(findings, key=lambda f: f.line)


def check_tests(folder: Path = TESTS) -> list[Finding]:
    return [f for path in sorted(folder.glob("*.py")) for f in check_source(path.read_text(), path.name)]


# --- the checker, on sources where the answer is known ------------------------------------

FLAGGED = '''
import time
from time import perf_counter as pc


def helper_elapsed(t0):
    return time.monotonic() - t0


def test_bad(x):
    assert True
    assert (x, "a tuple is always true")
    assert x == 1 or True
    t0 = time.perf_counter()
    x()
    assert time.perf_counter() - t0 < 0.5
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.5, f"took {elapsed}"
    start = pc()
    took = pc() - start
    assert 0 <= took <= 2
    dt = []
    for _ in range(3):
        t1 = time.monotonic()
        dt.append(time.monotonic() - t1)
    assert max(dt) < 1
    assert all(d < 1 for d in dt)
    answers = {}
    answers["a"] = (x, time.monotonic() - t0)
    for name, (resp, wall) in answers.items():
        assert resp.status == 200
        assert wall < 3
    assert helper_elapsed(t0) < 0.5
    deadline = time.monotonic() + 10
    while x():
        assert time.monotonic() < deadline, "timed out"
'''

CLEAN = '''
import time


def test_good(x):
    t0 = time.perf_counter()
    x()
    print(f"took {time.perf_counter() - t0:.3f} s")  # a report, not a threshold
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not x():  # a wait, not an assert
        time.sleep(0.1)
    calls = []
    x(calls.append)
    assert len(calls) == 1 and calls[0] is x
    assert x() or x.other(), "a BoolOp without a constant"
    assert x.elapsed < 1  # an attribute of the code under test: not this test's clock
    t = 5
    assert t < 10
'''


def test_the_checker_flags_each_always_true_assert_and_each_wall_clock_bound():
    found = check_source(FLAGGED, "planted.py")
    assert all(f.function == "test_bad" and f.key == "planted.py::test_bad" for f in found)
    kinds = [(f.kind, f.source.split(",")[0]) for f in found]
    assert kinds == [
        ("constant assert", "assert True"),
        ("constant assert", 'assert (x'),
        ("constant assert", "assert x == 1 or True"),
        ("time threshold", "assert time.perf_counter() - t0 < 0.5"),
        ("time threshold", "assert elapsed < 1.5"),
        ("time threshold", "assert 0 <= took <= 2"),
        ("time threshold", "assert max(dt) < 1"),
        ("time threshold", "assert all(d < 1 for d in dt)"),
        ("time threshold", "assert wall < 3"),
        ("time threshold", "assert helper_elapsed(t0) < 0.5"),
        ("time threshold", "assert time.monotonic() < deadline"),
    ], kinds


def test_the_checker_leaves_reports_waits_and_other_asserts_alone():
    assert check_source(CLEAN) == []


def test_a_planted_file_fails_the_check_of_its_folder(tmp_path):
    shutil.copy(TESTS / "test_suite_hygiene.py", tmp_path / "test_copy.py")  # this file: clean
    assert check_tests(tmp_path) == []
    (tmp_path / "test_planted.py").write_text(
        "import time\n\ndef test_x():\n    t = time.monotonic()\n    assert time.monotonic() - t < 0.01\n")
    assert [str(f) for f in check_tests(tmp_path)] == [
        "test_planted.py:5 (test_x): time threshold: assert time.monotonic() - t < 0.01"]


# --- the tree -----------------------------------------------------------------------------

def test_no_assert_in_the_suite_is_always_true():
    found = [f for f in check_tests() if f.kind == "constant assert"]
    assert not found, "asserts that check nothing:\n" + "\n".join(map(str, found))


def test_no_wall_clock_threshold_outside_the_named_promises():
    found = [f for f in check_tests() if f.kind == "time threshold"]
    unlisted = [f for f in found if f.key not in ALLOWED_TIME_THRESHOLDS]
    assert not unlisted, (
        "a wall-clock bound flakes on a busy CI machine; check identity, call counts or synthetic inputs"
        " instead (or, for a bound the product promises, name it in ALLOWED_TIME_THRESHOLDS with why):\n"
        + "\n".join(map(str, unlisted)))
    stale = sorted(set(ALLOWED_TIME_THRESHOLDS) - {f.key for f in found})
    assert not stale, f"ALLOWED_TIME_THRESHOLDS names functions without a wall-clock bound now: remove {stale}"


# --- the skip gate (tests/conftest.py), in a pytest of its own -----------------------------

@pytest.mark.parametrize(("reason", "passes"), [
    ("native tool missing", False),
    ("needs a CUDA GPU", True),
    ("no FIFOs on this platform", True),
])
def test_a_skip_fails_the_run_unless_it_is_for_missing_hardware(tmp_path, reason, passes):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")  # the gate as the suite runs it
    (tmp_path / "test_gate.py").write_text(textwrap.dedent(f"""
        import pytest

        def test_runs():
            pass

        def test_skipped():
            pytest.skip({reason!r})
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert "1 passed, 1 skipped" in out, out
    if passes:
        assert done.returncode == 0 and "SKIP REFUSED" not in out, out
    else:
        assert done.returncode == pytest.ExitCode.TESTS_FAILED, out
        line = f"SKIP REFUSED test_gate.py::test_skipped: {reason} -- make it run here"
        assert out.count("SKIP REFUSED") == 1 and line in out, out


def test_a_failing_run_keeps_its_exit_status_and_a_module_skip_is_a_skip(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_gone.py").write_text("import pytest\npytest.importorskip('no_such_package_here')\n")
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    raise AssertionError('no')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "SKIP REFUSED test_gone.py: could not import 'no_such_package_here'" in out, out

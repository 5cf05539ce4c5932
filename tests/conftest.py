"""Fixtures: the real test models (fetched by scripts/fetch_test_models.py, which the
test command runs first) and engines loaded once per session; and the skip gate: a run
with a skipped test fails unless the skip is for hardware or a platform this machine
lacks (HARDWARE_SKIP), so a claim the README makes is never quietly left untested."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/fakes.py

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache" / "localrun" / "test-models"))
SMOLLM2_GGUF = MODELS / "smollm2-135m-instruct-q4_1.gguf"
GEMMA3_GGUF = MODELS / "gemma-3-270m-q4_k_m.gguf"
SMOLLM2_MLX = MODELS / "smollm2-135m-instruct-mlx-f16"
QWEN_CODER_GGUF = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"  # tools template, FIM tokens
QWEN_CODER_15B_GGUF = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"  # the draft tests' target (0.5B drafts)

FETCH_HINT = "run scripts/fetch_test_models.py (scripts/test.sh, the README's test command, runs it)"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"test model {path.name} is missing: {FETCH_HINT}")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return _need(SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    return _need(GEMMA3_GGUF)


@pytest.fixture(scope="session")
def qwen_coder_gguf() -> Path:
    return _need(QWEN_CODER_GGUF)


@pytest.fixture(scope="session")
def qwen_coder_15b_gguf() -> Path:
    return _need(QWEN_CODER_15B_GGUF)


@pytest.fixture(scope="session")
def smollm2_mlx() -> Path:
    return _need(SMOLLM2_MLX / "config.json").parent


@pytest.fixture(scope="session")
def llama_engine(smollm2_gguf):
    from localrun.engine import Engine

    with Engine.open(smollm2_gguf, n_ctx=1024, n_seq=2) as eng:
        yield eng


@pytest.fixture(scope="session")
def mlx_engine(smollm2_mlx):
    from localrun.engine import Engine

    with Engine.open(smollm2_mlx, n_ctx=1024, n_seq=2) as eng:
        yield eng


@pytest.fixture(params=["llama.cpp", "mlx"])
def engine(request):
    """The same SmolLM2 weights on each backend: contract tests run once per backend."""
    return request.getfixturevalue("llama_engine" if request.param == "llama.cpp" else "mlx_engine")


# --- the skip gate ----------------------------------------------------------------------

# The only skip reasons a run accepts: hardware or a platform this machine lacks. Any other
# skip (a test model, a native tool, a package, a build option missing) fails the run, as
# a failed test would: setup must provide what the tests need.
HARDWARE_SKIP = re.compile(
    r"\b(GPUs?|CUDA|ROCm|Metal|Apple silicon|macOS|Windows|non-Linux|Linux test|on this platform)\b",
    re.IGNORECASE)
_skipped: list = []  # this session's skip reports, tests' and modules'


def pytest_sessionstart(session):
    _skipped.clear()


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):  # an xfail is not a skip
        _skipped.append(report)


def pytest_collectreport(report):
    if report.skipped:  # a module skipped whole (importorskip, allow_module_level)
        _skipped.append(report)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def refused_skips() -> list[tuple[str, str]]:
    """(test id, reason) of each skip of this session that HARDWARE_SKIP does not accept."""
    return [(r.nodeid, skip_reason(r)) for r in _skipped if not HARDWARE_SKIP.search(skip_reason(r))]


def pytest_sessionfinish(session, exitstatus):
    if refused_skips() and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    refused = refused_skips()
    if not refused:
        return
    terminalreporter.write_sep("=", f"{len(refused)} skip(s) fail this run", red=True)
    for nodeid, reason in refused:
        terminalreporter.write_line(
            f"SKIP REFUSED {nodeid}: {reason} -- make it run here (setup must provide what it needs) or fix the"
            " test; only a skip for hardware or a platform this machine lacks passes (HARDWARE_SKIP in"
            " tests/conftest.py)")

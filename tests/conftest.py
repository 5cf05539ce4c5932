"""Fixtures: the real test models (fetched by scripts/fetch_test_models.py, which the
test command runs first) and engines loaded once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/fakes.py

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache" / "localrun" / "test-models"))
SMOLLM2_GGUF = MODELS / "smollm2-135m-instruct-q4_1.gguf"
GEMMA3_GGUF = MODELS / "gemma-3-270m-q4_k_m.gguf"
SMOLLM2_MLX = MODELS / "smollm2-135m-instruct-mlx-f16"
QWEN_CODER_GGUF = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"  # tools template, FIM tokens

FETCH_HINT = "run scripts/fetch_test_models.py (the README's test command does)"


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

"""What the prompt-lookup instruments share, and scripts/bench/bench_lookup.py with them:
the test models by short name, the untimed warm-up answer's length, and the statistics of
paired speed ratios (the other benchmarks' A/B ratios use paired_ratio too)."""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

MODELS_DIR = Path(os.environ.get("LOCALRUN_TEST_MODELS", "~/.cache/localrun/test-models")).expanduser()
MODELS = {"smollm2": "smollm2-135m-instruct-q4_1.gguf", "gemma": "gemma-3-270m-q4_k_m.gguf",
          "qwen": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}
FETCH = "run scripts/fetch_test_models.py"
WARM_TOKENS = 16  # each engine's untimed first answer: weights paged in, buffers sized


# -- the test models ---------------------------------------------------------------------

def resolve_model(m: str) -> tuple[str, Path]:
    """(label, path) for a short name of MODELS, a file name in MODELS_DIR, or a path."""
    if m in MODELS:
        return m, MODELS_DIR / MODELS[m]
    path = Path(m) if Path(m).exists() else MODELS_DIR / m
    return next((k for k, f in MODELS.items() if f == path.name), path.stem[:8]), path


def no_model_files(paths: Iterable[Path]) -> bool:
    """Whether any of `paths` is missing; where one is, one error line names them all."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        print(f"error: no model file {', '.join(missing)}: {FETCH}", file=sys.stderr)
    return bool(missing)


def existing_model(m: str) -> tuple[str, Path]:
    """resolve_model for a script's --model: where the file is not there, one error line
    and exit status 2."""
    label, path = resolve_model(m)
    if no_model_files([path]):
        raise SystemExit(2)
    return label, path


# -- answers and speed ratios ------------------------------------------------------------

def first_diff(a, b) -> int | None:
    """Index of the first differing token, or None when the two are identical."""
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def geo_mean(xs) -> float | None:
    """The geometric mean, the right average of speed ratios (None and 0 left out)."""
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


# Student's t at 97.5% by degrees of freedom (the nearest listed at or below is taken)
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
         12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04, 60: 2.00, 120: 1.98}


def t975(df: int) -> float:
    """Student's t for a two-sided 95% interval with `df` degrees of freedom (df >= 1)."""
    return _T975[max(k for k in _T975 if k <= df)]


def paired_ratio(num: list, den: list) -> tuple[float, float, float] | None:
    """The geometric mean of repeat-by-repeat speed ratios and its 95% interval (t on the
    logs), or None under 2 pairs. A repeat runs every engine one after the other, so its
    two runs saw the same load: the ratio of medians mixes runs minutes apart, and on this
    project's shared CPU one task's speed wanders by +-8% from repeat to repeat (a chat's
    LU/off ranged 0.76-1.21 over 11 repeats whose paired mean was 0.97)."""
    logs = [math.log(a / b) for a, b in zip(num, den) if a and b]
    if len(logs) < 2:
        return None
    mean = statistics.fmean(logs)
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)

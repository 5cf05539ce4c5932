#!/usr/bin/env python3
"""Every tool-call family's required call on one model, either backend (issue 50).

    .venv/bin/python -m scripts.bench.check_tool_families                      # MLX SmolLM2, every family
    .venv/bin/python -m scripts.bench.check_tool_families --model smollm2-135m-instruct-q4_1.gguf --seeds 1 2

tests/test_tool_formats_models.py holds each family to its own syntax on the llama.cpp
backend (SmolLM2 every family, Qwen2.5-Coder three), and on MLX one family only: MLX's
CPU build reads a tool prompt at ~10-20 tok/s here, ~45 s a family, too slow for the
suite to take them all. This runs that test's own check (`run_family`: the family's
llama.cpp template, tool_choice "required", temperature 1.0 over the whole vocabulary,
the call in the family's syntax, parsed back, its arguments validated by jsonschema) for
every family and seed, and prints one line each: pass, or what failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # run_family imports its neighbours as the suite does

from test_tool_formats_models import FAMILIES, run_family  # noqa: E402

from localrun.engine import Engine  # noqa: E402

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache/localrun/test-models"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct-mlx-f16", help="a name in the test-model cache, or a path")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[3])
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    path = Path(a.model) if Path(a.model).exists() else MODELS / a.model
    unknown = [f for f in a.families.split(",") if f not in FAMILIES]
    if unknown or not path.exists():
        print(f"error: {'unknown family ' + ', '.join(unknown) if unknown else f'{path} not found'}"
              f" (families: {', '.join(FAMILIES)})", file=sys.stderr)
        return 2
    failed = 0
    with Engine.open(path, n_ctx=2048) as base:
        if path.is_dir():  # as the suite's MLX fixture: float32 is ~2.5x faster on MLX's CPU build
            import mlx.core as mx

            base.backend.model.set_dtype(mx.float32)
        for family in a.families.split(","):
            for seed in a.seeds:
                start = time.monotonic()
                try:
                    call = run_family(base, family, seed, a.max_tokens)
                    result = f"pass  {call.arguments}"
                except AssertionError as e:
                    failed += 1
                    result = f"FAIL  {str(e).splitlines()[0][:300]}"
                print(f"{family:13s} seed {seed}  {time.monotonic() - start:5.1f} s  {result}", flush=True)
    print(f"{failed} failed" if failed else "every family passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""How close is the selector's memory prediction to what a loaded model really takes?

For each test model and each context (2048, 8192): a fresh Python process loads the
model, prefills 512 tokens, decodes 128 more (greedy, no prompt lookup, EOS ignored)
and reports its peak RSS (ru_maxrss). The parent prints the prediction beside it.

llama.cpp allocates (and zeroes) the whole KV cache when the context is created, so
its prediction is for the asked context. mlx-lm's cache grows as tokens arrive (in
steps of 256), so an MLX model is predicted at the 640 tokens this run holds; its fit
verdict is judged at the full context.

Goal (issue 6): within 15%, never under by more than 10%. quant/selector.py's measured
overheads (OVERHEAD) come from this script. Exit status 1 where the goal is not met.

    .venv/bin/python -m scripts.bench.fit_accuracy [--json OUT.json] [--ctx N ...]

Last printed (--ctx 2048, the project's 2-core x86 CPU): predicted over measured peak RSS
+11.8% SmolLM2 Q4_1 (264/236 MiB), +3.0% Gemma-3 Q4_K_M (423/410 MiB), +5.2% SmolLM2 MLX
f16 (443/421 MiB): goal met.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache" / "localrun" / "test-models"))
TEST_MODELS = ("smollm2-135m-instruct-q4_1.gguf", "gemma-3-270m-q4_k_m.gguf", "smollm2-135m-instruct-mlx-f16")
PREFILL, DECODE = 512, 128

CHILD = r"""
import json, resource, sys
from localrun.engine import Engine
from localrun.sampling import SamplingParams

path, n_ctx, prefill, decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with Engine.open(path, n_ctx=n_ctx) as eng:
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
    tokens = eng.tokenize(text)[:prefill]
    assert len(tokens) == prefill, len(tokens)
    n = 0
    for ev in eng.generate(tokens, sampling=SamplingParams(temperature=0.0), max_tokens=decode,
                           ignore_eos=True, lookup=False):
        n += 1
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "events": n}))
"""


def measure(path: Path, n_ctx: int) -> int:
    res = subprocess.run([sys.executable, "-c", CHILD, str(path), str(n_ctx), str(PREFILL), str(DECODE)],
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"measurement of {path.name} at {n_ctx} failed:\n{res.stderr[-2000:]}")
    return int(json.loads(res.stdout.strip().splitlines()[-1])["peak_rss"])


def predict(path: Path, n_ctx: int):
    from localrun.quant.selector import Budget, estimate, model_shape, weights_bytes

    shape = model_shape(path)
    held = n_ctx if shape.backend == "llama.cpp" else -(-(PREFILL + DECODE) // 256) * 256
    return estimate(shape, weights_bytes(path), held, Budget.from_gb(1024), quant=path.name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--ctx", type=int, action="append", help="contexts to measure (default 2048 and 8192)")
    args = ap.parse_args()
    models = [MODELS / name for name in TEST_MODELS if (MODELS / name).exists()]
    if not models:
        raise SystemExit("no test models: run scripts/fetch_test_models.py")
    rows = []
    print(f"{'model':40} {'ctx':>5} {'predicted MiB':>13} {'measured MiB':>12} {'error':>7}  parts (weights/KV/buffers/overhead MiB)")
    for path in models:
        for n_ctx in args.ctx or [2048, 8192]:
            est = predict(path, n_ctx)
            peak = measure(path, n_ctx)
            err = (est.total - peak) / peak
            mib = 1 << 20
            parts = f"{est.weights / mib:.0f}/{est.kv / mib:.0f}/{est.buffers / mib:.0f}/{est.overhead / mib:.0f}"
            print(f"{path.name:40} {n_ctx:>5} {est.total / mib:>13.0f} {peak / mib:>12.0f} {100 * err:>+6.1f}%  {parts}",
                  flush=True)
            rows.append({"model": path.name, "n_ctx": n_ctx, "kv_cells": est.n_ctx, "predicted": est.total,
                         "measured": peak, "error": err, "weights": est.weights, "kv": est.kv,
                         "buffers": est.buffers, "overhead": est.overhead})
    ok = all(abs(r["error"]) <= 0.15 and r["error"] >= -0.10 for r in rows)
    print(f"goal (within 15%, never under by more than 10%): {'met' if ok else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

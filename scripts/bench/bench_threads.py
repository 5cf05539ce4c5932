#!/usr/bin/env python3
"""Benchmark (a script, not a test): the default thread count against every --threads N,
with one core kept busy by another process and then without it.

For each phase, in one process: the default engine (threads fitted to the load) and one
engine per N in 1..physical cores are opened while the phase's load runs, then each
decodes --n-gen tokens (greedy, prompt lookup off) once per round, interleaved, for
--repeat rounds. Prints decode tok/s medians, the thread count the default chose, and
default / best N (of the medians, and the median of same-round ratios); "busy" pins a
spinning process to CPU 0. "idle" means no spinner of ours: the load average printed
says how idle the machine really was. Writes JSON.

    python -m scripts.bench.bench_threads [--model smollm2.gguf] [--n-gen 100] [--repeat 3]

Goals (issue 16): busy, default >= 0.90x the best N; idle, default >= 0.95x today's
default (every physical core: the largest N).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache" / "localrun" / "test-models"))
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SPIN = "import os; os.sched_setaffinity(0, {0}) if hasattr(os, 'sched_setaffinity') else None\nwhile True: pass"


def spinner() -> subprocess.Popen:
    """Another process keeping one core busy (pinned to CPU 0 where the OS allows)."""
    return subprocess.Popen([sys.executable, "-c", SPIN])


def run_phase(model: Path, busy: bool, n_gen: int, repeat: int) -> dict:
    from localrun.engine import Engine
    from localrun.hardware import inference_threads
    from localrun.sampling import SamplingParams

    spin = spinner() if busy else None
    engines: dict[str, Engine] = {}
    try:
        time.sleep(0.5)  # the spinner is running before any load reading
        for n in [None, *range(1, inference_threads() + 1)]:
            engines["default" if n is None else f"threads={n}"] = Engine.open(model, n_ctx=1024, threads=n)
        greedy = dict(sampling=SamplingParams(temperature=0), ignore_eos=True, lookup=False)
        for eng in engines.values():  # warm-up
            eng.complete(PROMPT, max_tokens=8, **greedy)
        runs: dict[str, list[float]] = {name: [] for name in engines}
        chosen: list[int] = []
        for _ in range(repeat):
            for name, eng in engines.items():
                runs[name].append(eng.complete(PROMPT, max_tokens=n_gen, **greedy).timings.decode_tps)
                if name == "default":
                    chosen.append(eng.backend.threads)
    finally:
        for eng in engines.values():
            eng.close()
        if spin is not None:
            spin.kill()
            spin.wait()
    tps = {name: statistics.median(r) for name, r in runs.items()}
    fixed = {name: v for name, v in tps.items() if name != "default"}
    best = max(fixed, key=fixed.get)
    today = f"threads={inference_threads()}"

    def paired(other: str) -> float:
        """Median over rounds of default / other in the same round: a busy machine's
        speed drifts between rounds far more than between neighbouring runs."""
        return statistics.median(d / o for d, o in zip(runs["default"], runs[other]))

    return {"phase": "one core busy" if busy else "idle", "tok_s": tps, "runs": runs, "default_threads": chosen,
            "best": best, "default_over_best": tps["default"] / fixed[best], "paired_over_best": paired(best),
            "default_over_today": tps["default"] / fixed[today], "paired_over_today": paired(today),
            "load_avg": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODELS / "smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--n-gen", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench-threads.json")
    args = ap.parse_args()
    rows = [run_phase(Path(args.model), busy, args.n_gen, args.repeat) for busy in (True, False)]
    for r in rows:
        cells = "  ".join(f"{name} {v:6.1f}" for name, v in r["tok_s"].items())
        print(f"{r['phase']:14} tok/s: {cells}  | default chose {r['default_threads']}"
              f"  default/best({r['best']}) {r['default_over_best']:.2f} (paired {r['paired_over_best']:.2f})"
              f"  default/today {r['default_over_today']:.2f} (paired {r['paired_over_today']:.2f})"
              f"  load avg {r['load_avg'][0]:.1f}")
    Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

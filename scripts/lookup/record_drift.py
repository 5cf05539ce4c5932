#!/usr/bin/env python3
"""Record how this machine's speed drifts while a model steps: after one prompt, steps of
1 to 49 rows in a fixed interleaved cycle, each timed, for `--seconds`.

    python -m scripts.lookup.record_drift --model smollm2 --seconds 240 --out drift.json

It prints, per window of `--window` seconds, the one-row step's median ms and each width's
median over it: where the first column moves and the others hold, the machine's speed
drifted while the model's cost shape stayed (what localrun/speculation/step_cost.py assumes). The file
feeds `python -m scripts.lookup.replay_lookup --drift`, which replays drafting plans against this
recorded drift instead of a quiet machine.
"""

from __future__ import annotations

import argparse, json, statistics, sys, time
from pathlib import Path

from scripts.lookup.common import MODELS, existing_model
from scripts.lookup.lookup_tasks import task_engine
from scripts.lookup.replay_lookup import read_prompt, timed_step

# one-row steps between the wide ones, as a drafting answer's are
CYCLE = (1, 1, 20, 1, 49, 1, 1, 6, 1, 12, 1, 33, 1, 1, 3)
SHOWN = (3, 6, 12, 20, 33, 49)


def record(path: Path, seconds: float, threads: int, task: str = "edit") -> list[tuple[float, int, float]]:
    """(seconds since the start, rows, ms) of each timed step."""
    with task_engine(path, threads, [task]) as (eng, prompts):
        prompt = prompts[task]
        read_prompt(eng.backend, prompt)
        steps, start, i = [], time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            rows = CYCLE[i % len(CYCLE)]
            i += 1
            at = time.perf_counter() - start
            steps.append((at, rows, timed_step(eng.backend, prompt, rows) * 1000))
        return steps


def windows(steps, window: float) -> list[str]:
    """One line per window: the one-row median ms, and each shown width over it."""
    by_window: dict[int, dict[int, list[float]]] = {}
    for t, rows, ms in steps:
        by_window.setdefault(int(t // window), {}).setdefault(rows, []).append(ms)
    lines = []
    for w in sorted(by_window):
        widths = by_window[w]
        if 1 not in widths:
            continue
        one = statistics.median(widths[1])
        shape = " ".join(f"{r}:{statistics.median(widths[r]) / one:5.2f}" for r in SHOWN if r in widths)
        lines.append(f"  {w * window:5.0f} s  one-row {one:5.1f} ms   {shape}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help=f"short name {list(MODELS)} or a path")
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--window", type=float, default=20.0, help="seconds per printed line")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="where to write the recorded steps (JSON)")
    args = ap.parse_args(argv)
    label, path = existing_model(args.model)
    if args.seconds <= 0 or args.window <= 0:
        print("error: --seconds and --window must be above 0", file=sys.stderr)
        return 2
    steps = record(path, args.seconds, args.threads)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text(json.dumps({"model": label, "threads": args.threads, "steps": steps}))
    tmp.replace(out)
    print(f"{label}: {len(steps)} steps in {args.seconds:.0f} s; per {args.window:.0f} s, the one-row median "
          f"and each width's over it:")
    print("\n".join(windows(steps, args.window)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Benchmark (a script, not a test): tool-call decode speed under the call grammar vs
unconstrained text, on Qwen2.5-Coder-0.5B (issue 15's target: constrained >= 0.9x free).

Same model, same process, same prompt (so the same context depth), same number of
tokens: a `required` call of `write_file(path, content)` is generated first, then free
text of exactly as many tokens (EOS ignored). Prompt lookup is off so every step is one
token. Three sampler settings, because the grammar's cost depends on how much of the
mask the chain needs: greedy (the best token is checked, ~1 us), the default chain
(top-k 40: the best few), and full-vocabulary sampling (temperature 1, no top-k: the
whole mask every step). Rounds interleave the settings; medians of --repeat rounds.
Prints a table, writes JSON.

    python -m scripts.bench.bench_tools [--model qwen.gguf] [--n-gen 96] [--repeat 3]

Last printed (a short run, --n-gen 32 --repeat 1, on the project's 2-core x86 CPU under a
load average of ~3, so each ratio is one noisy pair): tools/free 0.99 greedy, 0.94
default chain, 1.01 full vocabulary (~26-30 tok/s). No test or other script runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache" / "localrun" / "test-models"))
QWEN = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TOOLS = [{
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write a text file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}]
ASK = "Write a Python module primes.py with a function that lists the first n prime numbers, and save it."


def bench(path: Path, threads: int | None, n_gen: int, repeat: int) -> dict:
    from localrun.engine import Engine
    from localrun.request import GenerationRequest
    from localrun.sampling import SamplingParams

    chains = {
        "greedy": SamplingParams(temperature=0),
        "default_chain": SamplingParams(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, seed=1),
        "full_vocab": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1),
    }
    runs: dict[str, dict[str, list[float]]] = {name: {"tools": [], "free": [], "tokens": []} for name in chains}
    with Engine.open(path, n_ctx=2048, threads=threads) as eng:
        prompt = eng.chat_prompt([{"role": "user", "content": ASK}], tools=TOOLS)

        def constrained(sampling, n):
            return eng.complete(prompt, GenerationRequest(sampling=sampling, max_tokens=n, lookup=False, tools=TOOLS,
                                                          tool_choice="required"))

        def free(sampling, n):
            return eng.complete(prompt, GenerationRequest(sampling=sampling, max_tokens=n, lookup=False, ignore_eos=True))

        for sampling in chains.values():  # warm-up: the grammar and its tokenizer table are built once
            constrained(sampling, 8)
            free(sampling, 8)
        for _ in range(repeat):
            for name, sampling in chains.items():
                c = constrained(sampling, n_gen)
                n = c.timings.generated_tokens  # a call may close before n_gen
                f = free(sampling, n)
                runs[name]["tools"].append(c.timings.decode_tps)
                runs[name]["free"].append(f.timings.decode_tps)
                runs[name]["tokens"].append(n)
    row: dict = {"model": path.name, "depth": len(prompt), "n_gen": n_gen, "repeat": repeat}
    for name, r in runs.items():
        tools, free_tps = statistics.median(r["tools"]), statistics.median(r["free"])
        row[name] = {"tools_tps": tools, "free_tps": free_tps, "ratio": tools / free_tps if free_tps else None,
                     "tokens": r["tokens"], "runs_tools": r["tools"], "runs_free": r["free"]}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(QWEN))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-gen", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench-tools.json")
    args = ap.parse_args()
    row = bench(Path(args.model), args.threads, args.n_gen, args.repeat)
    print(f"{row['model']}  (prompt {row['depth']} tokens, medians of {row['repeat']} interleaved rounds)")
    print(f"{'sampler':14} {'tools tok/s':>11} {'free tok/s':>10} {'tools/free':>10} {'tokens':>14}")
    for name in ("greedy", "default_chain", "full_vocab"):
        r = row[name]
        print(f"{name:14} {r['tools_tps']:11.1f} {r['free_tps']:10.1f} {r['ratio']:10.2f} {str(r['tokens']):>14}")
    Path(args.out).write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

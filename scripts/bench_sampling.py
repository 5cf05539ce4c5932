#!/usr/bin/env python3
"""Benchmark (a script, not a test): what the sampler chain and a grammar cost per token.

For each model, in one run and one process: decode tok/s of localrun with greedy, with
the default chain (top-k 40, top-p 0.95, min-p 0.05, temp 0.8, repeat penalty 1.1),
and with that chain under a JSON schema vs without; plus native llama-bench tg for the
same model, threads and context depth when it is built (scripts/build_llama_bench.sh).
Prompt lookup is off so every step is one token. Median of --repeat interleaved rounds.
Prints a table, writes JSON.

    python scripts/bench_sampling.py [--models a.gguf b.gguf] [--n-gen 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache" / "localrun" / "test-models"))
TOOLS = Path(os.environ.get("LOCALRUN_TOOLS", Path.home() / ".cache" / "localrun" / "tools"))
SCHEMA = {"type": "array", "minItems": 12, "items": {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}, "required": ["city", "population"]}}
PROMPT = "List many cities of the world with their population, as JSON."


def llama_bench_tg(model: Path, threads: int, n_gen: int, depth: int) -> float | None:
    """llama-bench's decode tok/s of n_gen tokens after `depth` tokens of context (one run)."""
    import llama_cpp

    exe = TOOLS / f"llama.cpp-{llama_cpp.__version__}" / "build" / "bin" / "llama-bench"
    if not exe.exists():
        return None
    out = subprocess.run([str(exe), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(n_gen), "-d", str(depth),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def bench_model(path: Path, threads: int, n_gen: int, repeat: int) -> dict:
    """Every setting once per round, rounds repeated, medians reported: on a 2-core
    machine speed drifts by ±10% over a minute, and back-to-back blocks of runs would
    read that drift as a difference between settings. llama-bench decodes at the same
    context depth as our runs (after the prompt)."""
    from localrun.engine import Engine
    from localrun.grammar import Grammar
    from localrun.sampling import SamplingParams

    chain = dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, repeat_penalty=1.1, seed=1)
    settings = {
        "greedy": dict(sampling=SamplingParams(temperature=0), ignore_eos=True),
        "default_chain": dict(sampling=SamplingParams(**chain), ignore_eos=True),
        "chain_unconstrained": dict(sampling=SamplingParams(**chain)),
        "chain_json_schema": dict(sampling=SamplingParams(**chain), grammar=Grammar.from_json_schema(SCHEMA)),
    }
    runs: dict[str, list[float]] = {name: [] for name in [*settings, "llama_bench_tg"]}
    with Engine.open(path, n_ctx=2048, threads=threads) as eng:
        prompt = eng.chat_prompt([{"role": "user", "content": PROMPT}]) if eng.info.chat_template else eng.tokenize(PROMPT + "\n[")
        depth = len(prompt if isinstance(prompt, list) else eng.tokenize(prompt))
        for kw in settings.values():  # warm-up; builds the grammar's vocabulary table once
            eng.complete(prompt, max_tokens=8, lookup=False, **kw)
        for _ in range(repeat):
            native = llama_bench_tg(path, threads, n_gen, depth)
            if native is not None:
                runs["llama_bench_tg"].append(native)
            for name, kw in settings.items():
                runs[name].append(eng.complete(prompt, max_tokens=n_gen, lookup=False, **kw).timings.decode_tps)
    row = {"model": path.name, "threads": threads, "n_gen": n_gen, "depth": depth}
    row.update({name: statistics.median(r) if r else None for name, r in runs.items()})
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=[str(MODELS / "smollm2-135m-instruct-q4_1.gguf"), str(MODELS / "gemma-3-270m-q4_k_m.gguf")])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench-sampling.json")
    args = ap.parse_args()
    rows = [bench_model(Path(m), args.threads, args.n_gen, args.repeat) for m in args.models]
    head = f"{'model':34} {'native tg':>9} {'greedy':>8} {'chain':>8} {'chain/native':>12} {'chain/greedy':>12} {'json':>8} {'json/free':>9}"
    print(head)
    for r in rows:
        native = r["llama_bench_tg"]
        print(
            f"{r['model']:34} {native or float('nan'):9.1f} {r['greedy']:8.1f} {r['default_chain']:8.1f} "
            f"{(r['default_chain'] / native) if native else float('nan'):12.2f} {r['default_chain'] / r['greedy']:12.2f} "
            f"{r['chain_json_schema']:8.1f} {r['chain_json_schema'] / r['chain_unconstrained']:9.2f}"
        )
    Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

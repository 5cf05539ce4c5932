#!/usr/bin/env python3
"""Prefill and decode speed of localrun against its peers, on the same models and threads.

    python -m scripts.bench.bench --quick            # smoke run: ~1-2 min on a quiet 2-core box
    python -m scripts.bench.bench                    # every test model, 3 rounds, medians
    python -m scripts.bench.bench --threads 1 --native-depth --lookup   # steadier on a busy box
    python -m scripts.bench.bench --models smollm2-135m-instruct-q4_1.gguf --repeat 5

Plain localrun rows run with prompt-lookup speculation off (the peers have none);
--lookup adds a `+lookup` row with it on. --native-depth makes llama-bench decode after
n-prompt tokens of KV, as every other engine here does, instead of from an empty cache.

GGUF rows: localrun's llama.cpp backend, native `llama-bench` built from the same llama.cpp
source (scripts/build_llama_tools.sh), and llama-cpp-python's high-level `Llama`; both
attend with the flash-attention setting localrun's backend chose (backends/attention.py),
so that a ratio compares engines, not attention kernels.
MLX rows: localrun's MLX backend and `mlx_lm.stream_generate`.

Every engine runs in its own process (scripts/bench/bench_peers.py) and is fed the same token
ids, made by localrun's tokenizer from a long English text; llama-bench makes its own
random prompt of the same length. --repeat rounds each run every engine once (fresh
process, one warm-up, empty cache); each number is the median over the rounds. Results
go to a table and to --out as JSON (per-run numbers included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from localrun.hardware import inference_threads

REPO = Path(__file__).resolve().parents[2]
PEERS = "scripts.bench.bench_peers"  # run with -m from REPO
SMOLLM2, GEMMA3, SMOLLM2_MLX = (
    "smollm2-135m-instruct-q4_1.gguf", "gemma-3-270m-q4_k_m.gguf", "smollm2-135m-instruct-mlx-f16")
WORKER_TIMEOUT_S = 900
# table row name -> bench_peers.py worker (llama-bench runs directly, not via a worker)
WORKER_OF = {"localrun": "localrun", "localrun-mlx": "localrun", "llama-cpp-python": "llama_cpp",
             "mlx_lm": "mlx_lm"}

# Varied sentences (numbers differ in each), so no stretch of the prompt repeats and a
# shifted window of it is a prompt with no shared prefix.
_SENTENCES = [
    "On day {n} the river rose by {m} centimetres, and the ferry to the east bank waited until noon.",
    "The library on {n} Harbour Street lends {m} books a week, most of them novels and old atlases.",
    "A farmer counted {m} sheep in the upper field at dawn and {n} more in the valley by evening.",
    "Engineers tested bridge number {n} with a load of {m} tonnes before the morning trains were allowed across.",
    "In the spring of year {n}, the village choir sang {m} songs at the festival beside the old mill.",
    "The recipe asks for {m} grams of flour, a pinch of salt, and an oven heated for {n} minutes.",
    "Ships leaving the northern port carried {m} crates of apples and {n} barrels of cider to the coast.",
]


def long_text(n_sentences: int = 400) -> str:
    return " ".join(_SENTENCES[k % len(_SENTENCES)].format(n=k + 3, m=(k * 37) % 1000 + 11)
                    for k in range(n_sentences))


def llama_bench_path(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    ver = metadata.version("llama-cpp-python")  # no need to load the shared library here
    tools = Path(os.environ.get("LOCALRUN_TOOLS", Path.home() / ".cache/localrun/tools"))
    return tools / f"llama.cpp-{ver}" / "build" / "bin" / "llama-bench"


def run_worker(engine: str, job: dict) -> dict:
    """Run one engine in a fresh interpreter; a crash or hang becomes an error row."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        p = subprocess.run([sys.executable, "-m", PEERS, engine, f.name], capture_output=True, cwd=REPO,
                           text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {WORKER_TIMEOUT_S}s"}
    finally:
        os.unlink(f.name)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT "):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-6:]
    return {"error": f"exit {p.returncode}: " + " | ".join(tail)}


def run_native(exe: Path, model: Path, threads: int, n_prompt: int, n_gen: int, repeat: int,
               depth: bool = False, flash_attn: str = "auto") -> dict:
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(repeat), "-fa", flash_attn, "-o", "json"]
    # llama-bench decodes from an empty cache; the other engines decode after the prompt.
    # With depth, tg also runs at depth n_prompt and that is the row's decode number.
    if depth:
        cmd += ["-d", f"0,{n_prompt}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {WORKER_TIMEOUT_S}s", "cmd": cmd}
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: " + " | ".join(p.stderr.strip().splitlines()[-6:]), "cmd": cmd}
    tests = json.loads(p.stdout)
    samples: dict = {}
    for t in tests:  # one entry for the pp test (n_gen 0), one for tg (n_prompt 0)
        key = "prefill_tps" if t["n_gen"] == 0 else "decode_tps"
        if t.get("n_depth", 0) == (n_prompt if depth and key == "decode_tps" else 0):
            samples[key] = t["samples_ts"]
    # one run per repetition, shaped like a worker's runs so that summarize() fits both
    runs = [{k: v[i] for k, v in samples.items()} for i in range(repeat)]
    return {"runs": runs, "cmd": cmd, "raw": tests}


def summarize(res: dict) -> dict:
    """Median per metric over the worker's runs; keep the runs for the JSON."""
    if "error" in res or "runs" not in res:
        return res
    for key in ("prefill_tps", "decode_tps"):
        vals = [r[key] for r in res["runs"] if r.get(key)]
        res[key] = statistics.median(vals) if vals else None
        # other load only ever slows a run down, so the spread shows how much to trust it
        res[key + "_min"], res[key + "_max"] = (min(vals), max(vals)) if vals else (None, None)
    return res


def make_prompts(model: Path, threads: int, n_ctx: int, n_prompt: int, repeat: int) -> dict:
    tok = run_worker("tokens", {"model": str(model), "threads": threads, "n_ctx": n_ctx,
                                "text": long_text()})
    if "error" in tok:
        return tok
    special, body = tok["special"], tok["body"]
    n_body = n_prompt - len(special)
    if len(body) < n_body + repeat + 16:
        return {"error": f"text gave only {len(body)} tokens; need {n_body + repeat + 16}"}
    # repeat i starts i tokens further into the text: same length, no common prefix
    prompts = [special + body[i:i + n_body] for i in range(repeat)]
    return {"prompts": prompts, "warm": special + body[-16:]}


def bench_model(model: Path, a: argparse.Namespace) -> list[dict]:
    is_mlx = model.is_dir()
    n_prompt, n_gen = (a.mlx_n_prompt, a.mlx_n_gen) if is_mlx else (a.n_prompt, a.n_gen)
    n_ctx = max(2048, n_prompt + n_gen + 32)
    base = {"model": model.name, "n_prompt": n_prompt, "n_gen": n_gen, "threads": a.threads}
    pr = make_prompts(model, a.threads, n_ctx, n_prompt, a.repeat)
    if "error" in pr:
        return [{**base, "engine": "localrun", "error": "tokenize: " + pr["error"]}]
    job = {"model": str(model), "threads": a.threads, "n_ctx": n_ctx, "n_gen": n_gen, "warm": pr["warm"]}
    engines = ["localrun-mlx", "mlx_lm"] if is_mlx else ["localrun", "llama-bench", "llama-cpp-python"]
    if a.skip_native and "llama-bench" in engines:
        engines.remove("llama-bench")
    if a.lookup:
        engines.insert(1, engines[0] + "+lookup")
    # Rounds, not one engine's repeats back to back: each round runs every engine once,
    # each in a fresh process, so load that comes and goes on a shared machine hits all
    # engines alike and the medians stay comparable.
    got: dict[str, dict] = {eng: {"runs": []} for eng in engines}
    for rnd in range(a.repeat):
        for eng in engines:
            if "error" in got[eng]:
                continue  # it failed once; it will fail again, so save the time
            print(f"  {model.name}: round {rnd + 1}/{a.repeat} {eng} ...", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            if eng == "llama-bench":
                res = run_native(a.llama_bench, model, a.threads, n_prompt, n_gen, 1, a.native_depth,
                                 job.get("flash_attn", "auto"))
            else:
                worker = WORKER_OF[eng.split("+")[0]]
                res = run_worker(worker, {**job, "prompts": [pr["prompts"][rnd]],
                                          "lookup": eng.endswith("+lookup")})
            got[eng]["elapsed_s"] = got[eng].get("elapsed_s", 0.0) + time.monotonic() - t0
            if "error" in res:
                print(f"    error: {res['error']}", file=sys.stderr)
                got[eng]["error"] = res["error"]
                continue
            if "flash_attn" in res:  # localrun runs first in a round: the peers attend as it chose
                job["flash_attn"] = res["flash_attn"]
            got[eng]["runs"] += res.pop("runs")
            got[eng].update(res)  # cmd / raw / version: the last round's
    rows = [{**base, "engine": eng, **summarize(got[eng])} for eng in engines]
    # ratios against the reference peer of the same model (native for GGUF, mlx_lm for MLX)
    ref_name = "mlx_lm" if is_mlx else "llama-bench"
    ref = next((r for r in rows if r["engine"] == ref_name and "error" not in r), None)
    for r in rows:
        for key in ("prefill", "decode"):
            mine, theirs = r.get(f"{key}_tps"), ref and ref.get(f"{key}_tps")
            r[f"{key}_ratio"] = mine / theirs if mine and theirs else None
        r["ratio_vs"] = ref_name if ref else None
    return rows


def print_table(rows: list[dict]) -> None:
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    def span(r, key):
        lo, hi = r.get(key + "_min"), r.get(key + "_max")
        return f"{lo:.1f}-{hi:.1f}" if lo and hi and hi > lo else ""

    head = ["model", "engine", "prefill tok/s", "decode tok/s", "decode min-max", "prefill ratio",
            "decode ratio", "vs"]
    body = [[r["model"], r["engine"], num(r.get("prefill_tps"), ".1f"), num(r.get("decode_tps"), ".1f"),
             span(r, "decode_tps"),
             num(r.get("prefill_ratio"), ".2f"), num(r.get("decode_ratio"), ".2f"),
             "ERROR: " + r["error"][:60] if "error" in r else (r.get("ratio_vs") or "-")] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    for i, line in enumerate([head] + body):
        print(" | ".join(str(x).ljust(w) for x, w in zip(line, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", help="file/dir names in the test-model cache, or paths")
    ap.add_argument("--threads", type=int, default=inference_threads())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--mlx-n-prompt", type=int, default=128, help="MLX on a Linux CPU is slow")
    ap.add_argument("--mlx-n-gen", type=int, default=32)
    ap.add_argument("--skip-mlx", action="store_true")
    ap.add_argument("--skip-native", action="store_true", help="no llama-bench row")
    ap.add_argument("--native-depth", action="store_true",
                    help="llama-bench decode at depth n-prompt (-d), as the other engines decode")
    ap.add_argument("--lookup", action="store_true",
                    help="add a localrun row with prompt-lookup speculation on (off in the plain row)")
    ap.add_argument("--llama-bench", help="path to llama-bench (default: built by build_llama_tools.sh)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, n-gen 32 (MLX p64/n16), smollm2 only")
    ap.add_argument("--out", default="bench-results.json")
    a = ap.parse_args()

    cache = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache/localrun/test-models"))
    if a.quick:
        # MLX decodes a few tok/s on a Linux CPU: a smoke run keeps its share short too
        a.repeat, a.n_gen = 1, min(a.n_gen, 32)
        a.mlx_n_prompt, a.mlx_n_gen = min(a.mlx_n_prompt, 64), min(a.mlx_n_gen, 16)
        a.models = a.models or [SMOLLM2, SMOLLM2_MLX]
    names = a.models or [SMOLLM2, GEMMA3, SMOLLM2_MLX]
    models = []
    for name in names:
        p = Path(name) if Path(name).exists() else cache / name
        if p.is_dir() and a.skip_mlx:
            continue
        if not p.exists():
            what = "MLX model" if not name.endswith(".gguf") else "model"
            print(f"note: {what} {p} is missing; skipping it (python scripts/fetch_test_models.py makes it)",
                  file=sys.stderr)
            continue
        models.append(p.resolve())  # the workers run in REPO

    if not models:
        print("error: no model to benchmark", file=sys.stderr)
        return 2
    if not a.skip_native:
        a.llama_bench = llama_bench_path(a.llama_bench)
        if not a.llama_bench.is_file():
            print(f"note: {a.llama_bench} not found; build it with `bash scripts/build_llama_tools.sh`"
                  " (~10-20 min on 2 cores) or pass --skip-native / --llama-bench PATH", file=sys.stderr)
            a.skip_native = True

    # Other work on the machine skews every row; say so rather than report quietly.
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        print(f"warning: load average {load_start:.1f} before starting; numbers will be noisy",
              file=sys.stderr)
        if a.threads > 1 and load_start + a.threads > (os.cpu_count() or 1) + 0.5:
            # llama.cpp's threads spin at each barrier: one thread short and decode collapses
            print(f"  (with --threads {a.threads} on {os.cpu_count()} CPUs they must share; "
                  "--threads 1 gives steadier numbers)", file=sys.stderr)
    print(f"threads={a.threads} repeat={a.repeat} gguf: p{a.n_prompt}/n{a.n_gen} "
          f"mlx: p{a.mlx_n_prompt}/n{a.mlx_n_gen}", file=sys.stderr)
    rows = [r for m in models for r in bench_model(m, a)]
    print_table(rows)
    meta = {"threads": a.threads, "repeat": a.repeat, "n_prompt": a.n_prompt, "n_gen": a.n_gen,
            "mlx_n_prompt": a.mlx_n_prompt, "mlx_n_gen": a.mlx_n_gen,
            "native_depth": a.native_depth, "lookup_row": a.lookup, "python": sys.version.split()[0],
            "machine": platform.machine(), "cpu": platform.processor() or None,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0],
            "llama_bench": None if a.skip_native else str(a.llama_bench)}
    for pkg in ("llama-cpp-python", "mlx", "mlx-lm"):
        try:
            meta[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            meta[pkg] = None
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {a.out}", file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

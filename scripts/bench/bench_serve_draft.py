"""`localrun serve --draft` against native `llama-server -md` under concurrent clients (issue 53).

    python -m scripts.bench.bench_serve_draft                 # 1.5B + 0.5B draft, 1/2/4/8 clients, 2 rounds
    python -m scripts.bench.bench_serve_draft --quick         # 1 round, 1 and 4 clients, 32 tokens

Four servers, all up for the whole run and taking turns run by run (an idle one uses no
CPU), each with the same target, threads, slots (--parallel 4) and context per slot:
localrun without a draft model, localrun with `--draft`, llama-server, and llama-server
with `-md DRAFT --spec-type draft-simple --spec-draft-n-max 8` (the fixed draft length
issue 53 measured). C clients stream `/completion` at once (a code prompt, temperature
0, ignore_eos); aggregate tok/s = all tokens / wall time from the first request sent to
the last token (bench_serve.concurrent). localrun's requests send `"lookup": false`, so
that its rows are the draft model's alone. The table gives each server's draft / no-draft
ratio and localrun-with-draft over llama-server-with-draft: the goals are >= 0.98 and
>= 1.0 at every client count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from importlib import metadata
from pathlib import Path

from scripts.bench.bench_serve import NATIVE, TOOLS, Server, concurrent, table
from scripts.fetch_test_models import QWEN_CODER, QWEN_CODER_15B, cache_dir
from tests.serving import free_port

PROMPT = ("<|im_start|>user\nWrite a Python function `merge_intervals(intervals)` that merges overlapping"
          " intervals, with a docstring and type hints.<|im_end|>\n<|im_start|>assistant\n")
VARIANTS = ("localrun", "localrun+draft", NATIVE, f"{NATIVE}+draft")


def servers(a: argparse.Namespace) -> dict[str, list[str]]:
    exe = a.llama_server or str(TOOLS / f"llama.cpp-{metadata.version('llama-cpp-python')}/build/bin/llama-server")
    mine = [sys.executable, "-m", "localrun.cli", "serve", "--model", a.target, "--threads", str(a.threads),
            "--parallel", str(a.parallel), "--ctx", str(a.ctx), "--keep-alive", "-1"]
    native = [exe, "-m", a.target, "-t", str(a.threads), "-tb", str(a.threads), "-np", str(a.parallel),
              "-c", str(a.ctx * a.parallel), "--no-kv-unified", "--no-webui"]
    return {"localrun": mine, "localrun+draft": mine + ["--draft", a.draft],
            NATIVE: native, f"{NATIVE}+draft": native + ["-md", a.draft, "--spec-type", "draft-simple",
                                                         "--spec-draft-n-max", "8"]}


def summarize(runs: dict, clients: list[int]) -> list[dict]:
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    div = lambda x, y: x / y if x and y else None  # noqa: E731
    rows = []
    for c in clients:
        tps = {v: med([r["tps"] for r in runs[v][c] if "tps" in r]) for v in runs}
        rows.append({"clients": c, **tps,
                     "localrun draft/off": div(tps.get("localrun+draft"), tps.get("localrun")),
                     "server draft/off": div(tps.get(f"{NATIVE}+draft"), tps.get(NATIVE)),
                     "draft: localrun/server": div(tps.get("localrun+draft"), tps.get(f"{NATIVE}+draft"))})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(cache_dir() / QWEN_CODER_15B))
    ap.add_argument("--draft", default=str(cache_dir() / QWEN_CODER))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--tokens", type=int, default=64, help="n_predict per client")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--llama-server", help="path to llama-server (default: built by build_llama_tools.sh)")
    ap.add_argument("--quick", action="store_true", help="1 round, 1 and 4 clients, 32 tokens")
    ap.add_argument("--json", help="write every run and the medians here")
    a = ap.parse_args(argv)
    if a.quick:
        a.repeat, a.clients, a.tokens = 1, [1, 4], 32
    for p in (a.target, a.draft):
        if not Path(p).is_file():
            ap.error(f"{p} not found (python scripts/fetch_test_models.py fetches the test models)")
    started: dict[str, Server] = {}
    runs = {v: {c: [] for c in a.clients} for v in VARIANTS}
    try:
        for name, cmd in servers(a).items():
            port = free_port()
            print(f"{name}: {' '.join(cmd[3:] if cmd[0] == sys.executable else cmd)} (port {port})", file=sys.stderr)
            started[name] = Server(name, cmd + ["--port", str(port)], port)
        for r in range(a.repeat):
            for c in a.clients:
                for name, srv in started.items():
                    body = {"prompt": PROMPT, "n_predict": a.tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True, "cache_prompt": True,
                            **({"lookup": False} if name.startswith("localrun") else {})}
                    runs[name][c].append(concurrent(srv.url, body, c))
                print(f"  round {r + 1} x{c}: " + "  ".join(f"{n} {runs[n][c][-1].get('tps', 0):.1f}"
                                                          for n in started), file=sys.stderr, flush=True)
    finally:
        for srv in started.values():
            srv.stop()
    rows = summarize(runs, a.clients)
    print(f"\naggregate decode tok/s (median of {a.repeat}), --parallel {a.parallel}, {a.tokens} tokens per client")
    table(list(rows[0]), [list(r.values()) for r in rows])
    errors = [f"{v} x{c}: {r['error']}" for v in runs for c in runs[v] for r in runs[v][c] if "error" in r]
    for e in errors:
        print("error:", e)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs, "rows": rows}, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""`localrun serve` against native `llama-server -np 4` under concurrent streaming clients.

    python -m scripts.bench.bench_serve --quick          # smoke run: 1 repeat, 32 tokens
    python -m scripts.bench.bench_serve                  # SmolLM2, 1/2/4/8 clients, 3 repeats, medians
    python -m scripts.bench.bench_serve --model gemma3 --json serve.json

Both servers get the same GGUF (a copy with FIM token ids, tests/serving.py, so /infill works),
threads, slots and context per slot (llama-server splits -c over its slots: -c ctx*parallel);
llama-server is built from the llama.cpp source llama-cpp-python vendors. Both are up for the
whole run and take turns run by run (an idle one uses no CPU), so drift hits both alike.
Decode: C clients stream `/completion` at once (fixed prompt,
temperature 0, ignore_eos); aggregate tok/s = all generated tokens / wall time from the first
request sent to the last token. localrun runs with `"lookup": false` and with its default
prompt-lookup speculation. Infill: TTFT of `/infill` on a ~1.5k-token code file, cold (a file
no slot has seen) and warm (the same file after typing at the cursor), the typing sent in
llama.vim's shape (the cursor's line in `prompt`, after the FIM middle mark) and in the
whole-prefix shape other editors use. For context: the batching gain native llama.cpp gets on the same
model and threads (llama-bench ppB/pp1, llama-batched-bench).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import httpx

from tests.serving import FIM_IDS, free_port, make_fim_copy, stop_process

REPO = Path(__file__).resolve().parents[2]

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache/localrun/test-models"))
ALIASES = {"smollm2": MODELS / "smollm2-135m-instruct-q4_1.gguf", "gemma3": MODELS / "gemma-3-270m-q4_k_m.gguf"}
TOOLS = Path(os.environ.get("LOCALRUN_TOOLS", Path.home() / ".cache/localrun/tools"))
PROMPT = ("The old lighthouse keeper climbed the stairs every evening at dusk. On the night the storm came,"
          " he saw a light far out at sea, and")
NATIVE = "llama-server"


class Server:
    """A server process on a free port; ready once /health answers 200 (llama-server says
    503 while it loads) and one short generation has run (localrun loads on first use)."""

    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.stop()[-3000:]
                raise SystemExit(f"error: {name} did not start ({' '.join(cmd)}); its log:\n{log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:  # not listening yet: try again after the pause below
                pass
            time.sleep(0.3)
        stream_one(self.url, "/completion", {"prompt": "Hello", "n_predict": 4, "stream": True})

    def stop(self) -> str:
        """Stop the process, delete its log and return the log's text."""
        stop_process(self.proc)
        self.log.close()
        text = Path(self.log.name).read_text(errors="replace")
        Path(self.log.name).unlink(missing_ok=True)
        return text


def stream_one(url: str, path: str, body: dict) -> dict:
    """One streaming request; times are perf_counter seconds. Both servers send SSE `data:`
    lines, the last with stop=true, tokens_predicted and timings (cache_n, prompt_n, ...)."""
    sent = time.perf_counter()
    first = final = None
    with httpx.Client(timeout=600) as client, client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path} -> HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"{path} -> in-stream error: {ev['error']}")
            if first is None and ev.get("content"):  # text the editor can show (a healed token may write none)
                first = time.perf_counter()
            if ev.get("stop"):
                final = ev
    end = time.perf_counter()
    if final is None:
        raise RuntimeError(f"{path}: the stream ended without a final (stop=true) event")
    t = final.get("timings", {})
    return {"sent": sent, "end": end, "ttft_ms": 1000 * ((first or end) - sent),
            "tokens": final.get("tokens_predicted", 0), "cache_n": t.get("cache_n"),
            "prompt_n": t.get("prompt_n"), "prompt_ms": t.get("prompt_ms"),
            "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted")}


def concurrent(url: str, body: dict, n: int) -> dict:
    """n clients send the same request at once (a barrier releases them together)."""
    gate = threading.Barrier(n)

    def client(_) -> dict | Exception:
        gate.wait()
        try:
            return stream_one(url, "/completion", body)
        except Exception as exc:  # noqa: BLE001 - reported in the row, not a traceback per thread
            return exc

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(client, range(n)))
    errors = [str(r) for r in results if isinstance(r, Exception)]
    if errors:
        return {"error": errors[0]}
    wall = max(r["end"] for r in results) - min(r["sent"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    short = [r["tokens"] for r in results if r["tokens"] != body["n_predict"]]
    # drafted and accepted tokens of each client (llama-server leaves them out without a draft)
    drafts = [(r["draft_n"], r["draft_n_accepted"]) for r in results if r["draft_n"] is not None]
    return {"tps": tokens / wall, "wall_s": wall, "tokens": tokens, "short": short,
            "ttft_ms": statistics.median(r["ttft_ms"] for r in results), "drafts": drafts}


def code_file(variant: int, n_funcs: int) -> str:
    """Plausible Python whose every line depends on `variant`, so two repeats share no prefix."""
    head = f"# inventory module {variant}: helpers generated for the fill-in-the-middle benchmark\nimport math\n\n"
    funcs = []
    for i in range(n_funcs):
        k, s = (i + variant) % 7 + 2, (i * 13 + variant) % 17 + 1
        funcs.append(
            f"def restock_{variant}_{i}(items, scale={s}):\n"
            f'    """Weighted stock of every {k}th item, scaled by {s}; the rest wear down."""\n'
            f"    total = {i + variant}\n"
            f"    for index, item in enumerate(items):\n"
            f"        if index % {k} == 0:\n"
            f"            total += item.count * scale\n"
            f"        else:\n"
            f"            total -= math.floor(item.count / {k})\n"
            f"    return total\n")
    return head + "\n\n".join(funcs)


def fim_requests(url: str, variant: int, target: int) -> tuple[dict, dict, dict, int]:
    """/infill bodies for a file of about `target` tokens, the cursor in the second-to-last
    function after `total += `: cold (a file no slot has seen), then two warm ones after
    the user typed "item." at the cursor, in the two shapes editors send.
    - "line": llama.vim's shape. The cursor's line up to the cursor goes in `prompt`,
      which follows the FIM middle mark, so typing changes only the prompt's last tokens.
    - "prefix": the whole text before the cursor in `input_prefix` (Ollama's `suffix` FIM,
      Continue, Zed). Where the server keeps the cursor at the prefix's end (llama-server
      does, in both shapes), typing changes the prefix's end, so the suffix and the FIM
      marks after it are read again (~130 tokens here); localrun moves the cursor's line
      after the middle mark in both shapes (server/fim.py).
    TTFT is the first event with text: a healed token (fim.py) may write none."""
    count = lambda text: len(httpx.post(url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"])  # noqa: E731
    per_func = count(code_file(variant, 10)) / 10
    text = code_file(variant, max(3, round(target / per_func)))
    cut = text.rindex("total += ", 0, text.rindex("def ")) + len("total += ")
    line = text.rindex("\n", 0, cut) + 1
    body = {"input_prefix": text[:line], "prompt": text[line:cut], "input_suffix": text[cut:], "n_predict": 4,
            "temperature": 0, "ignore_eos": True, "stream": True, "cache_prompt": True}
    warm_line = dict(body, prompt=text[line:cut] + "item.")
    warm_prefix = dict(body, input_prefix=text[:cut] + "item.", prompt="")
    return body, warm_line, warm_prefix, count(text)


def decode_rounds(servers: dict, a: argparse.Namespace) -> dict:
    """Every decode variant of every server at every client count, `repeat` rounds, the
    servers taking turns run by run: on a 2-core machine speed drifts by ±15% over
    minutes, and a block of runs per server would read that drift as a difference
    between the servers. An idle server waits on its socket and uses no CPU."""
    runs: dict = {v: {c: [] for c in a.clients} for _, variants in servers.values() for v in variants}
    for _ in range(a.repeat):
        for c in a.clients:
            for server, variants in servers.values():
                for v, extra in variants.items():
                    body = {"prompt": PROMPT, "n_predict": a.tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True, "cache_prompt": True, **extra}
                    runs[v][c].append(concurrent(server.url, body, c))
    return runs


def fim_pairs(server: Server, a: argparse.Namespace) -> list:
    """Cold, then warm /infill TTFT in both editor shapes, `repeat` times, each on a file no
    slot has seen. Each warm shape edits the cold request: the cold one is sent again
    (untimed) before the second shape, or that shape would be timed against the first
    one's edit. (llama-server writes `prompt` at the end of the prefix, so its "prefix"
    shape after its "line" shape is the very same prompt: 1509 of 1510 tokens cached.)"""
    fim = []
    for r in range(a.repeat):
        cold, warm_line, warm_prefix, n_tok = fim_requests(server.url, r + 1, a.fim_tokens)
        try:
            c, wl = (stream_one(server.url, "/infill", body) for body in (cold, warm_line))
            stream_one(server.url, "/infill", cold)  # back to the state the prefix shape edits
            wp = stream_one(server.url, "/infill", warm_prefix)
        except (RuntimeError, httpx.HTTPError) as exc:
            fim.append({"file_tokens": n_tok, "error": str(exc)})
            continue
        for d in (c, wl, wp):  # absolute clock readings mean nothing outside this process
            del d["sent"], d["end"]
        fim.append({"file_tokens": n_tok, "cold": c, "warm_line": wl, "warm_prefix": wp})
    return fim


def hardware_gain(model: Path, threads: int, sizes: list[int], tokens: int, repeat: int) -> dict:
    """The batching gain the hardware offers at each batch size B, as native llama.cpp measures
    it: llama-bench ppB/pp1 (one B-token batch vs one token, the issue's yardstick) and
    llama-batched-bench S_TG(B)/S_TG(1) (B sequences decoding together, KV and all).
    Medians over `repeat` runs, like the server numbers."""
    bindir = TOOLS / f"llama.cpp-{metadata.version('llama-cpp-python')}" / "build" / "bin"
    npl, out = ",".join(map(str, sorted({1, *sizes}))), {}
    jobs = {  # name -> (command, how many times to run it)
        "llama_bench": ([bindir / "llama-bench", "-m", model, "-t", threads, "-n", 0, "-r", repeat, "-o", "json",
                         "-p", npl], 1),
        "batched_bench": ([bindir / "llama-batched-bench", "-m", model, "-t", threads, "-tb", threads,
                           "-c", max(2048, max(sizes) * (32 + tokens)), "-npp", 32, "-ntg", tokens, "-npl", npl,
                           "--output-format", "jsonl"], repeat),
    }
    for name, (cmd, times) in jobs.items():
        if not cmd[0].is_file():
            out[name + "_error"] = f"{cmd[0]} is not built (add {cmd[0].name} to scripts/build_llama_tools.sh)"
            continue
        samples: dict = {}  # batch size -> tokens/s of every run
        for _ in range(times):
            try:
                p = subprocess.run([str(x) for x in cmd], capture_output=True, text=True, timeout=1800)
                if name == "llama_bench":  # one JSON array; n_prompt B -> every repetition's tokens/s
                    for t in json.loads(p.stdout):
                        samples.setdefault(t["n_prompt"], []).extend(t["samples_ts"])
                else:  # one JSON line per batch size among its log lines
                    for line in (p.stdout + "\n" + p.stderr).splitlines():
                        if line.startswith('{"n_kv_max"'):
                            r = json.loads(line)
                            samples.setdefault(r["pl"], []).append(r["speed_tg"])
            except subprocess.TimeoutExpired:
                out[name + "_error"] = "timed out after 1800 s"
                break
            except (ValueError, KeyError):
                out[name + "_error"] = f"exit {p.returncode}: " + " | ".join(p.stderr.strip().splitlines()[-3:])
        tps = {b: statistics.median(v) for b, v in samples.items()}
        if 1 in tps and all(b in tps for b in sizes):
            out[name], out[name + "_tps"] = {b: tps[b] / tps[1] for b in sizes}, tps
        else:
            out.setdefault(name + "_error", f"no result for batch sizes {npl}")
    return out


def table(head: list[str], rows: list[list]) -> None:
    cell = lambda v: f"{v:.2f}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    body = [[cell(v) for v in r] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    for i, line in enumerate([head] + body):
        print(" | ".join(x.rjust(w) for x, w in zip(line, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def summarize(res: dict, clients: list[int], slots: int) -> dict:
    """Medians per table cell; gains are against the first client count, and the hardware's
    gain is read at min(clients, slots), since neither server batches more than its slots."""
    dec, hw = res["decode"], res["hardware"]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    div = lambda x, y: x / y if x and y else None  # noqa: E731
    tps = {v: {c: med([s["tps"] for s in dec[v][c] if "tps" in s]) for c in clients} for v in dec}
    get = lambda v, c: tps.get(v, {}).get(c)  # noqa: E731
    c0 = clients[0]
    decode = [{"clients": c, "localrun": get("localrun", c), "localrun+lookup": get("localrun+lookup", c),
               NATIVE: get(NATIVE, c), "ratio": div(get("localrun", c), get(NATIVE, c)),
               "ratio_lookup": div(get("localrun+lookup", c), get(NATIVE, c)),
               "localrun_gain": div(get("localrun", c), get("localrun", c0)),
               "native_gain": div(get(NATIVE, c), get(NATIVE, c0)),
               "llama_bench_gain": hw.get("llama_bench", {}).get(min(c, slots)),
               "batched_bench_gain": hw.get("batched_bench", {}).get(min(c, slots))} for c in clients]
    fim = []
    for name, runs in res["fim"].items():
        runs = [f for f in runs if "error" not in f]
        if not runs:
            continue  # its errors are among the notes
        cold = med([f["cold"]["ttft_ms"] for f in runs])
        for shape in ("line", "prefix"):
            warm = med([f[f"warm_{shape}"]["ttft_ms"] for f in runs])
            w = runs[-1][f"warm_{shape}"]
            fim.append({"server": name, "warm shape": shape, "file_tokens": runs[-1]["file_tokens"],
                        "cold_ttft_ms": cold, "warm_ttft_ms": warm, "cold_over_warm": div(cold, warm),
                        "warm_cache_prompt": f"{w['cache_n']}/{w['prompt_n']}"})
    notes = [f"{name} /infill: {f['error']}" for name, runs in res["fim"].items() for f in runs if "error" in f]
    notes += [f"{v} x{c}: {s['error']}" for v in dec for c in dec[v] for s in dec[v][c] if "error" in s]
    notes += [f"{v} x{c}: generated {s['short']} tokens, not n_predict" for v in dec for c in dec[v]
              for s in dec[v][c] if s.get("short")]
    notes += [f"{k}: {v}" for k, v in hw.items() if k.endswith("error")]
    return {"decode": decode, "fim": fim, "notes": notes}


def report(summary: dict) -> None:
    print("\naggregate decode tok/s (median); C/1 = gain over the first client count; ppB/pp1 and"
          " batched B/1 = llama.cpp's own gain at B = min(clients, slots)")
    print("(ppB/pp1 asks logits of one row of a B-token batch; B streams need B rows, and on a CPU the output"
          " layer costs each row a share of a step (Gemma-3's 262k vocabulary: a third): batched B/1 includes them)")
    table(["clients", "localrun", "+lookup", NATIVE, "ratio", "ratio+lookup", "localrun C/1", "server C/1",
           "ppB/pp1", "batched B/1"], [list(r.values()) for r in summary["decode"]])
    print("\n/infill TTFT ms (median); cache/prompt = the servers' own cache_n/prompt_n for the warm request")
    print("warm shape: line = typing goes to `prompt`, the cursor's line (llama.vim); prefix = to `input_prefix`")
    table(["server", "warm shape", "file tokens", "cold TTFT", "warm TTFT", "cold/warm", "warm cache/prompt"],
          [list(r.values()) for r in summary["fim"]])
    for note in summary["notes"]:
        print("note:", note)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF path, or smollm2 / gemma3 (the test models)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="n_predict per client")
    ap.add_argument("--clients", default="1,2,4,8", help="comma-separated concurrent client counts")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=4, help="slots on both servers")
    ap.add_argument("--ctx", type=int, default=4096, help="context per slot (the FIM file must fit)")
    ap.add_argument("--fim-tokens", type=int, default=1500, help="size of the /infill code file")
    ap.add_argument("--llama-server", help="path to llama-server (default: built by build_llama_tools.sh)")
    ap.add_argument("--skip-native", action="store_true", help="localrun only")
    ap.add_argument("--skip-hardware", action="store_true", help="no llama-bench / llama-batched-bench run")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 32 tokens")
    ap.add_argument("--json", help="write every sample and the medians here")
    a = ap.parse_args()
    try:
        clients = sorted({int(c) for c in a.clients.split(",")})
        assert clients[0] >= 1
    except (ValueError, AssertionError):
        ap.error(f"--clients must be positive integers separated by commas, got {a.clients!r}")
    a.clients = clients
    if a.quick:
        a.repeat, a.tokens = 1, 32
    if a.repeat < 1 or a.tokens < 1 or a.threads < 1 or a.parallel < 1:
        ap.error("--repeat, --tokens, --threads and --parallel must be at least 1")
    if not 200 <= a.fim_tokens <= 1600 or a.ctx * 3 // 4 < a.fim_tokens + 64:
        # localrun's /infill keeps 3/4 of the context; llama-server's at most 1536 prefix
        # tokens (3/4 of its default batch): beyond either, the two would read different text
        ap.error(f"--fim-tokens must be 200..1600 and fit 3/4 of --ctx ({a.ctx}); got {a.fim_tokens}")
    model = ALIASES.get(a.model, Path(a.model))
    if not model.is_file():
        ap.error(f"model {model} not found (python scripts/fetch_test_models.py fetches the test models)")
    exe = Path(a.llama_server or TOOLS / f"llama.cpp-{metadata.version('llama-cpp-python')}/build/bin/llama-server")
    if not a.skip_native and not exe.is_file():
        ap.error(f"{exe} not found: build it with `bash scripts/build_llama_tools.sh` or pass --skip-native")
    if os.getloadavg()[0] > 0.5:
        print(f"warning: load average {os.getloadavg()[0]:.1f}: other work skews every number", file=sys.stderr)

    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    fim_model = model
    from gguf import GGUFReader  # the test models lack FIM ids; a code model has its own
    if not any(k in GGUFReader(str(model)).fields for k in FIM_IDS):
        # SmolLM2's spare control ids; in another vocabulary they are mere placeholders,
        # which is all a timing needs (both servers get the very same copy)
        fim_model = make_fim_copy(model, tmp / model.name)
    common = {"threads": a.threads, "parallel": a.parallel, "ctx_per_slot": a.ctx}
    servers = {
        "localrun": ([sys.executable, "-m", "localrun.cli", "serve", "--model", str(fim_model), "--threads",
                      str(a.threads), "--parallel", str(a.parallel), "--ctx", str(a.ctx), "--keep-alive", "-1"],
                     {"localrun": {"lookup": False}, "localrun+lookup": {}}),
        NATIVE: ([str(exe), "-m", str(fim_model), "-t", str(a.threads), "-tb", str(a.threads), "-np",
                  str(a.parallel), "-c", str(a.ctx * a.parallel), "--no-kv-unified", "--no-webui"],
                 {NATIVE: {}}),
    }
    if a.skip_native:
        del servers[NATIVE]
    res: dict = {"meta": {"model": str(model), "tokens": a.tokens, "repeat": a.repeat, "clients": a.clients,
                          "loadavg_start": os.getloadavg()[0], **common}, "decode": {}, "fim": {}}
    started: dict = {}
    name = ""
    try:  # a server that crashes or answers garbage ends the run with its own words
        for name, (cmd, variants) in servers.items():
            port = free_port()
            print(f"{name}: {' '.join(cmd[:3])} ... (port {port})", file=sys.stderr)
            started[name] = (Server(name, cmd + ["--port", str(port)], port), variants)
        name = "decode"
        res["decode"] = decode_rounds(started, a)
        for name, (srv, _) in started.items():
            res["fim"][name] = fim_pairs(srv, a)
    except (RuntimeError, httpx.HTTPError, ValueError) as exc:
        print(f"error: {name}: {exc}", file=sys.stderr)
        return 1
    finally:
        for srv_name, (srv, _) in started.items():
            log = srv.stop()
            if srv_name == NATIVE:  # llama-server logs its per-slot context: check it is --ctx
                m = re.search(r"n_ctx_slot = (\d+)", log)
                res["meta"]["llama_server_n_ctx_slot"] = n = int(m.group(1)) if m else None
                if n != a.ctx:
                    print(f"warning: llama-server reports {n} tokens per slot, not --ctx {a.ctx}", file=sys.stderr)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    res["hardware"] = {} if a.skip_hardware else hardware_gain(
        model, a.threads, sorted({min(c, a.parallel) for c in a.clients}), a.tokens, a.repeat)
    res["meta"]["loadavg_end"] = os.getloadavg()[0]
    res["summary"] = summarize(res, a.clients, a.parallel)
    report(res["summary"])
    if a.json:
        part = Path(a.json + ".tmp")
        part.write_text(json.dumps(res, indent=1, default=str))
        part.replace(a.json)
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

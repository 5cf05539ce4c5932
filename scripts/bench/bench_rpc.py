"""Decode speed of a GGUF split over two loopback `localrun rpc-worker`s against the same
model run locally, and what each generated token puts on the wire.

    .venv/bin/python -m scripts.bench.bench_rpc [--model PATH] [--tokens 64] [--repeat 3] [--json OUT]

Four setups, one after the other: local; two workers reached directly from this process;
the same two with the model in a child process, as `serve --rpc` hosts it
(backends/remote.py: a pipe call per decode, logits rows through shared memory); and
the same two through a TCP proxy of this script that counts bytes and turns (a turn: the
client sends, then waits for an answer: one network round trip). Bytes and turns are
counted from the first generated token to the last, so the prompt's prefill and the
weights sent at load are left out (the load's bytes are printed apart).

Loopback shares this machine's cores between the client and both workers: it measures
what the RPC layer costs, never a gain. The last column adds what a 1 Gb/s LAN would:
bytes / 125 MB/s plus turns x --lan-rtt-ms. Needs llama-cpp-python built with GGML_RPC
(scripts/setup.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.serving import free_port

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = Path.home() / ".cache" / "localrun" / "test-models" / "smollm2-135m-instruct-q4_1.gguf"
PROMPT = "Write a long story about a lighthouse keeper and a storm."
LAN_BYTES_PER_S = 125e6  # 1 Gb/s


def start_worker(port: int, threads: int, log_dir: Path) -> subprocess.Popen:
    err = log_dir / f"worker-{port}.err"
    proc = subprocess.Popen([sys.executable, "-m", "localrun.cli", "rpc-worker", "--port", str(port),
                             "--threads", str(threads)], stdout=subprocess.DEVNULL, stderr=open(err, "w"), cwd=ROOT)
    deadline = time.monotonic() + 120
    while "serving" not in err.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"rpc-worker on port {port} did not start: {err.read_text()}")
        time.sleep(0.2)
    return proc


# -- the counting proxy (a process of its own, so it does not share the client's GIL) --------

UP, DOWN, TURNS = 0, 1, 2


def _proxy_main(listen_port: int, target_port: int, counters) -> None:
    async def pipe(reader, writer, index: int, state: dict) -> None:
        try:
            while data := await reader.read(1 << 16):
                counters[index] += len(data)
                if index == DOWN and state["last"] == UP:
                    counters[TURNS] += 1  # the answer to what the client sent
                state["last"] = index
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return  # one side hung up: the pipe is done, the counts so far stand
        finally:
            writer.close()

    async def handle(client_r, client_w) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        for w in (client_w, server_w):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state = {"last": DOWN}
        await asyncio.gather(pipe(client_r, server_w, UP, state), pipe(server_r, client_w, DOWN, state))

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        ctx = mp.get_context("spawn")  # a fresh interpreter: the client has llama.cpp's threads by now
        self.counters = ctx.RawArray("Q", 3)  # one writer (the proxy); reads need no lock
        self.proc = ctx.Process(target=_proxy_main, args=(self.port, target_port, self.counters), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the counting proxy did not start") from None
                time.sleep(0.05)

    def snapshot(self) -> tuple[int, int, int]:
        return tuple(self.counters)


# -- measurements --------------------------------------------------------------------


def run_once(model: str, args, workers, proxies=(), hosted: bool = False) -> dict:
    """hosted: the model runs in a child process (RemoteBackend), as `serve --rpc` runs it."""
    from localrun.backends.llamacpp import LlamaCppBackend
    from localrun.backends.remote import RemoteBackend
    from localrun.engine import Engine
    from localrun.request import GenerationRequest
    from localrun.sampling import SamplingParams

    def totals():
        snaps = [p.snapshot() for p in proxies]
        return [sum(s[i] for s in snaps) for i in range(3)]

    before_load = totals()
    backend = (RemoteBackend if hosted else LlamaCppBackend)(model, n_ctx=1024, threads=args.threads, cluster=workers)
    loaded = totals()
    engine = Engine(backend)
    try:
        request = GenerationRequest(sampling=SamplingParams(temperature=0), max_tokens=args.tokens, ignore_eos=True,
                                    lookup=False)
        first, last = None, None
        for ev in engine.generate(engine.chat_prompt([{"role": "user", "content": PROMPT}]), request):
            if first is None:
                first = totals()  # prefill and the first token are behind us
            last = ev
        end = totals()
    finally:
        engine.close()
    t = last.timings
    n = max(1, t.generated_tokens - 1)
    return {"decode_tps": t.decode_tps, "load_bytes": sum(loaded[:2]) - sum(before_load[:2]),
            "bytes_per_token": (end[UP] + end[DOWN] - first[UP] - first[DOWN]) / n,
            "up_per_token": (end[UP] - first[UP]) / n, "turns_per_token": (end[TURNS] - first[TURNS]) / n,
            "placement": backend.placement.describe() if backend.placement else "local"}


def measure(model: str, args, workers=None, proxies=(), hosted: bool = False) -> dict:
    runs = [run_once(model, args, workers, proxies, hosted) for _ in range(args.repeat)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "placement"}
    out["placement"] = runs[0]["placement"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per run (default 64)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per setup; the median is reported (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="client threads (default 1)")
    ap.add_argument("--worker-threads", type=int, default=1, help="threads of each worker (default 1)")
    ap.add_argument("--tensor-split", default="1,1,1", help="this machine, worker 1, worker 2 (default 1,1,1)")
    ap.add_argument("--lan-rtt-ms", type=float, default=0.3, help="round trip of the LAN to project onto (default 0.3)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    from localrun.cluster import rpc

    ok, why = rpc.availability()
    if not ok:
        raise SystemExit(f"bench_rpc: {why}")
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    ports = [free_port(), free_port()]
    procs = [start_worker(p, args.worker_threads, log_dir) for p in ports]
    proxies = [Proxy(p) for p in ports]
    try:
        split = rpc.parse_tensor_split(args.tensor_split, 2)
        local = measure(args.model, args)
        direct = rpc.connect([rpc.Endpoint("127.0.0.1", p) for p in ports], split)
        remote = measure(args.model, args, direct)
        hosted = measure(args.model, args, direct, hosted=True)  # a worker serves one client: after the above
        counted = rpc.connect([rpc.Endpoint("127.0.0.1", p.port) for p in proxies], split)
        wire = measure(args.model, args, counted, proxies)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()

    lan_ms = wire["bytes_per_token"] / LAN_BYTES_PER_S * 1000 + wire["turns_per_token"] * args.lan_rtt_ms
    lan_tps = 1000 / (1000 / remote["decode_tps"] + lan_ms) if remote["decode_tps"] else 0.0
    child_ratio = hosted["decode_tps"] / remote["decode_tps"] if remote["decode_tps"] else 0.0
    rows = [
        ("setup", "decode tok/s", "vs local", "bytes/token", "turns/token", "1 Gb/s LAN adds"),
        ("local", f"{local['decode_tps']:.1f}", "1.00", "-", "-", "-"),
        ("2 loopback workers", f"{remote['decode_tps']:.1f}", f"{remote['decode_tps'] / local['decode_tps']:.2f}",
         f"{wire['bytes_per_token'] / 1024:.1f} KB", f"{wire['turns_per_token']:.1f}",
         f"{lan_ms:.2f} ms/token (~{lan_tps:.1f} tok/s)"),
        ("  model in a child process", f"{hosted['decode_tps']:.1f}",
         f"{hosted['decode_tps'] / local['decode_tps']:.2f}", "", "", ""),
        ("  through the counting proxy", f"{wire['decode_tps']:.1f}", f"{wire['decode_tps'] / local['decode_tps']:.2f}",
         "", "", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"{Path(args.model).name}, {args.tokens} tokens, median of {args.repeat}; split: {remote['placement']}")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"model in a child process (serve --rpc) / in this process: {child_ratio:.2f} of the decode tok/s")
    print(f"load sent {wire['load_bytes'] / 2**20:.1f} MiB of weights to the workers;"
          f" {wire['up_per_token'] / 1024:.1f} KB/token client->workers")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "tokens": args.tokens, "local": local,
                                               "rpc": remote, "rpc_child_process": hosted,
                                               "child_vs_in_process": child_ratio, "wire": wire,
                                               "lan_ms_per_token": lan_ms, "lan_rtt_ms": args.lan_rtt_ms}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

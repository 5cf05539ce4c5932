#!/usr/bin/env python3
"""Benchmark (a script, not a test): what the sampler chain and a grammar cost per token.

For each model, in one run and one process: decode tok/s of localrun with greedy, with
the default chain (top-k 40, top-p 0.95, min-p 0.05, temp 0.8, repeat penalty 1.1),
and with that chain under a JSON schema vs without; plus native llama-bench tg for the
same model, threads and context depth when it is built (scripts/build_llama_tools.sh).
Prompt lookup is off so every step is one token. Median of --repeat interleaved rounds,
and the round-by-round ratios' geometric mean with its 95% interval (chain / greedy:
the issue's >= 0.97), and the ratio that the engine loop's measured cost outside decode
implies at greedy's speed (thread CPU, so the machine's drift between rounds, ±6% on
this 2-core CPU over 9 rounds, does not blur it). Prints a table, writes JSON.

Then, per model, where the time outside `decode` goes (CPU time of the calling thread,
so a busy machine's preemption is not counted; llama.cpp runs on one thread here so its
compute stays out of the numbers): each stage of the chain per token, on logits rows
captured from a real generation, once with the row in cache and once evicted first (a
fresh row after a decode is mostly not in cache); and, inside the real engine loop,
sampling vs the rest (UTF-8, stop matching, events, step bookkeeping) per token, greedy
vs the default chain, interleaved rounds, medians. Each chain runs twice: on the fused
path (localrun/sampling/fused.py: its phases are the "stages") and stage by stage
("staged", the reference the fused path must match), so one run shows before and after.
The engine-loop numbers are the ones that count: right after a decode the caches hold
the weights, and a stage costs there 2-3x what it costs on a captured row.

    python -m scripts.bench.bench_sampling [--models a.gguf b.gguf] [--n-gen 128] [--repeat 3]
    python -m scripts.bench.bench_sampling --stages-only      # just the per-stage costs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from scripts.lookup.common import paired_ratio

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache" / "localrun" / "test-models"))
TOOLS = Path(os.environ.get("LOCALRUN_TOOLS", Path.home() / ".cache" / "localrun" / "tools"))
SCHEMA = {"type": "array", "minItems": 12, "items": {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}, "required": ["city", "population"]}}
PROMPT = "List many cities of the world with their population, as JSON."


def llama_bench_tg(model: Path, threads: int, n_gen: int, depth: int, flash_attn: str) -> float | None:
    """llama-bench's decode tok/s of n_gen tokens after `depth` tokens of context (one run),
    attending as localrun's backend chose to."""
    import llama_cpp

    exe = TOOLS / f"llama.cpp-{llama_cpp.__version__}" / "build" / "bin" / "llama-bench"
    if not exe.exists():
        return None
    out = subprocess.run([str(exe), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(n_gen), "-d", str(depth),
                          "-fa", flash_attn, "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def bench_model(path: Path, threads: int, n_gen: int, repeat: int) -> dict:
    """Every setting once per round, rounds repeated, medians reported: on a 2-core
    machine speed drifts by ±10% over a minute, and back-to-back blocks of runs would
    read that drift as a difference between settings. The order rotates by round.
    llama-bench decodes at the same context depth as our runs (after the prompt)."""
    from localrun.engine import Engine
    from localrun.grammar.core import Grammar
    from localrun.sampling import SamplingParams

    chain = dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, repeat_penalty=1.1, seed=1)
    settings = {
        "greedy": dict(sampling=SamplingParams(temperature=0), ignore_eos=True),
        "params_default": dict(sampling=SamplingParams(seed=1), ignore_eos=True),  # repeat penalty off
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
        names = list(settings)
        for r in range(repeat):
            native = llama_bench_tg(path, threads, n_gen, depth, eng.backend.flash_attn)
            if native is not None:
                runs["llama_bench_tg"].append(native)
            # each round starts at a different setting: the one right after llama-bench
            # (both cores busy for seconds) would otherwise always be the same
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(eng.complete(prompt, max_tokens=n_gen, lookup=False, **settings[name]).timings.decode_tps)
    row = {"model": path.name, "threads": threads, "n_gen": n_gen, "depth": depth}
    row.update({name: statistics.median(r) if r else None for name, r in runs.items()})
    # a round's settings ran minutes apart at most, its neighbours' up to an hour: the
    # round-by-round ratios resolve what a ratio of medians cannot on this CPU
    row["paired"] = {label: paired_ratio(runs[num], runs[den]) for label, (num, den) in PAIRED.items()}
    return row


def chain_vs_greedy(path: Path, threads: int, n_gen: int, rounds: int) -> dict:
    """The issue's chain/greedy alone, settled by many short A/B rounds: greedy and the
    chain (with repeat 1.1) alternate generation by generation, the order flipping each
    round, so a round's pair sees the same load and a trend cancels. Every step's wall
    clock is split into decode and the rest, so a cost that the chain's longer gap puts
    on the next decode (llama.cpp's worker threads cooling between decodes) shows as a
    slower decode after chain steps, which thread CPU outside decode cannot see."""
    from localrun.engine import Engine
    from localrun.sampling import SamplingParams

    settings = {"greedy": dict(temperature=0),
                "chain": dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, repeat_penalty=1.1, seed=1)}
    tps: dict[str, list[float]] = {name: [] for name in settings}
    walls: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in settings}
    with Engine.open(path, n_ctx=2048, threads=threads) as eng:
        prompt = eng.chat_prompt([{"role": "user", "content": PROMPT}]) if eng.info.chat_template else eng.tokenize(PROMPT + "\n[")
        decode = eng.backend.decode
        last = {}

        def timed_decode(batch):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return decode(batch)
            finally:
                last["wall"], last["cpu"] = time.perf_counter() - t0, time.thread_time() - c0

        eng.backend.decode = timed_decode
        try:
            for kw in settings.values():  # warm-up
                eng.complete(prompt, max_tokens=8, lookup=False, sampling=SamplingParams(**kw), ignore_eos=True)
            names = list(settings)
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    gen = eng.start(prompt, sampling=SamplingParams(**settings[name]), max_tokens=n_gen,
                                    ignore_eos=True, lookup=False, stop=STOPS)
                    eng.step([gen])  # the prompt, and the first token
                    at = walls[name]
                    while not gen.done:
                        t0 = time.perf_counter()
                        events = eng.step([gen])
                        step = time.perf_counter() - t0
                        at["decode wall"].append(last["wall"])
                        at["decode thread CPU"].append(last["cpu"])
                        at["outside decode wall"].append(step - last["wall"])
                        at["step wall"].append(step)
                    ev = events[gen.seq]
                    tps[name].append(ev.timings.decode_tps)
                    eng.release(gen)
        finally:
            del eng.backend.decode
    return {"model": path.name, "threads": threads, "n_gen": n_gen, "rounds": rounds,
            "tps": {name: statistics.median(v) for name, v in tps.items()},
            "paired": paired_ratio(tps["chain"], tps["greedy"]),
            "steps": {name: len(at["step wall"]) for name, at in walls.items()},
            "us": {name: {k: _median_us(v) for k, v in at.items()} for name, at in walls.items()},
            "mean_step_us": {name: 1e6 * statistics.fmean(at["step wall"]) for name, at in walls.items()}}


def print_chain_vs_greedy(rows: list[dict]) -> None:
    print("chain (top-k 40, top-p 0.95, min-p 0.05, temp 0.8, repeat 1.1) / greedy, A/B rounds:")
    for r in rows:
        paired = "paired {:.3f} ({:.3f}-{:.3f})".format(*r["paired"]) if r["paired"] else "paired: needs 2 rounds or more"
        print(f"  {r['model']:34} {r['rounds']} rounds x {r['n_gen']} tokens, {r['threads']} threads: "
              f"greedy {r['tps']['greedy']:.1f} tok/s, chain {r['tps']['chain']:.1f}, {paired}")
        for name, per in r["us"].items():
            print(f"    {name:7} per step, medians: " + "  ".join(f"{k} {v:.1f} us" for k, v in per.items())
                  + f"  (mean step {r['mean_step_us'][name]:.1f} us)")


PAIRED = {"chain/greedy": ("default_chain", "greedy"), "dflt/greedy": ("params_default", "greedy")}

CHAINS = {  # SamplingParams() is llama-server's default chain; the bench adds a repeat penalty
    "default": {},
    "default+rep1.1": dict(repeat_penalty=1.1),
}
STOPS = ["\nUser:", "</answer>"]  # stop matching runs on every token, as in a chat request
_EVICT = np.ones(4 << 20, np.float32)  # 16 MiB: more than the caches that hold a row


def _timed_sampler(params, vocab):
    """A Sampler that records each stage's thread CPU time per token (`cost`: name ->
    list of seconds; `next_token()` starts a token's entries)."""
    from localrun.sampling import Sampler
    from localrun.sampling.fused import FusedChain

    class TimedFused(FusedChain):  # the fused path's phases, recorded as stages
        __slots__ = ("owner",)

        def _timed(self, name, fn, *a):
            t0 = time.thread_time()
            try:
                return fn(*a)
            finally:
                self.owner.token[name] += time.thread_time() - t0

        def penalise(self, row, history):
            return self._timed("fused penalties", super().penalise, row, history)

        def restore(self, row, saved):
            return self._timed("fused penalties", FusedChain.restore, row, saved)

        def top(self, row):
            return self._timed("fused top_k", super().top, row)

        def truncate(self, ids, x):
            return self._timed("fused top_p/min_p/temp/softmax", super().truncate, ids, x)

    class Timed(Sampler):
        def __init__(self, *a):
            super().__init__(*a)
            self.cost: dict[str, list[float]] = defaultdict(list)
            self.token: dict[str, float] = defaultdict(float)

        def _stage(self, name, c, history):
            t0 = time.thread_time()
            super()._stage(name, c, history)
            self.token[name] += time.thread_time() - t0

        def sample(self, row, history):
            self.token = defaultdict(float)
            t0 = time.thread_time()
            if self.params.greedy:
                token = super().sample(row, history)
                self.token["argmax (greedy)"] = time.thread_time() - t0 - sum(self.token.values())
            elif self._fused is not None:
                token = super().sample(row, history)
                self.token["draw"] = time.thread_time() - t0 - sum(self.token.values())
            else:
                ids, probs = self.distribution(row, history)
                t1 = time.thread_time()
                self.token["final softmax"] = (t1 - t0) - sum(self.token.values())
                token = self.draw(ids, probs)
                self.commit(token, ids, probs)
                self.token["draw"] = time.thread_time() - t1
            self.token["sample (total)"] = time.thread_time() - t0
            for name, v in self.token.items():
                self.cost[name].append(v)
            return token

    timed = Timed(params, vocab)
    if timed._fused is not None:
        f = timed._fused
        timed._fused = TimedFused(f.k, f.pre, f.lean, f.tail)
        timed._fused.owner = timed
    return timed


def _staged(sampler):
    """The sampler with its fused path off: the chain stage by stage (the reference)."""
    sampler._fused = None
    return sampler


def _chains():
    """(name, SamplingParams keywords, staged?): greedy, then each chain fused and staged."""
    yield "greedy", dict(temperature=0), False
    for chain, kw in CHAINS.items():
        yield chain, kw, False
        yield f"{chain} (staged)", kw, True


def _median_us(values) -> float:
    return 1e6 * statistics.median(values)


def stage_costs(eng, prompt, n_rows: int) -> dict:
    """Per-token microseconds of each stage (medians over the rows), per chain, with the
    row in cache and evicted first."""
    from localrun.sampling import SamplingParams

    rows: list[tuple[np.ndarray, list[int]]] = []
    gen = eng.start(prompt, sampling=SamplingParams(seed=3), max_tokens=n_rows, ignore_eos=True, lookup=False)
    decode = eng.backend.decode

    def keep_rows(batch):
        out = decode(batch)
        if out and len(out[0]):
            rows.append((np.array(out[0][-1]), list(gen.history)))
        return out

    eng.backend.decode = keep_rows
    try:
        while not gen.done:
            eng.step([gen])
    finally:
        del eng.backend.decode
        eng.release(gen)
    out = {}
    for chain, kw, staged in _chains():
        for cold in (False, True):
            s = _timed_sampler(SamplingParams(seed=1, **kw), eng.token_text)
            if staged:
                _staged(s)
            for _ in range(3):
                for row, hist in rows:
                    if cold:
                        _EVICT.sum()
                    s.sample(row, hist)
            out[f"{chain} {'evicted' if cold else 'in cache'}"] = {k: _median_us(v) for k, v in s.cost.items()}
    return out


def engine_overhead(eng, prompt, n_gen: int, repeat: int) -> dict:
    """Per-token thread CPU microseconds outside decode in the real loop (medians over
    every step of `repeat` interleaved rounds): sampling, the token's way out (_accept:
    bytes, UTF-8, grammar, stop matching, the Event), and the rest of the step."""
    from localrun.sampling import SamplingParams

    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.thread_time() - t0
        return call

    eng.backend.decode = timed("decode", eng.backend.decode)
    eng._accept = timed("accept", eng._accept)
    steps: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    try:
        for _ in range(repeat):
            for chain, kw, staged in _chains():
                gen = eng.start(prompt, sampling=SamplingParams(seed=1, **kw), max_tokens=n_gen + 1,
                                ignore_eos=True, lookup=False, stop=STOPS)
                if staged:
                    _staged(gen.sampler)
                gen.sampler.sample = timed("sample", gen.sampler.sample)
                eng.step([gen])  # the prompt, and the first token
                while not gen.done:
                    spent.clear()
                    t0 = time.thread_time()
                    eng.step([gen])
                    outside = time.thread_time() - t0 - spent["decode"]
                    at = steps[chain]
                    at["sample"].append(spent["sample"])
                    at["accept (utf8, stops, event)"].append(spent["accept"])
                    at["rest of step"].append(outside - spent["sample"] - spent["accept"])
                    at["outside decode"].append(outside)
                    at["decode"].append(spent["decode"])
                eng.release(gen)
    finally:
        del eng.backend.decode, eng._accept  # back to the class's methods
    return {chain: {k: _median_us(v) for k, v in at.items()} for chain, at in steps.items()}


def overhead_report(path: Path, n_gen: int, repeat: int) -> dict:
    from localrun.engine import Engine

    with Engine.open(path, n_ctx=2048, threads=1) as eng:
        prompt = eng.chat_prompt([{"role": "user", "content": PROMPT}]) if eng.info.chat_template else eng.tokenize(PROMPT)
        eng.complete(prompt, max_tokens=4, lookup=False)  # warm-up
        report = {"model": path.name, "n_vocab": eng.info.n_vocab,
                  "stages_us": stage_costs(eng, prompt, n_gen), "engine_us": engine_overhead(eng, prompt, n_gen, repeat)}
    print(f"\n{path.name} (n_vocab {report['n_vocab']}): per-token thread CPU, microseconds")
    for chain, per in report["stages_us"].items():
        cells = "  ".join(f"{k} {v:.1f}" for k, v in per.items() if v >= 0.05 or k == "sample (total)")
        print(f"  stages, {chain:35} {cells}")
    for chain, per in report["engine_us"].items():
        print(f"  engine loop, {chain:25} " + "  ".join(f"{k} {v:.1f}" for k, v in per.items()))
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=[str(MODELS / "smollm2-135m-instruct-q4_1.gguf"), str(MODELS / "gemma-3-270m-q4_k_m.gguf")])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench-sampling.json")
    ap.add_argument("--stages-only", action="store_true", help="only the per-stage and engine-loop costs")
    ap.add_argument("--ab", type=int, metavar="ROUNDS", help="only chain/greedy, settled by ROUNDS alternating A/B rounds")
    args = ap.parse_args()
    if args.ab:
        rows = [chain_vs_greedy(Path(m), args.threads, args.n_gen, args.ab) for m in args.models]
        print_chain_vs_greedy(rows)
        Path(args.out).write_text(json.dumps({"chain_vs_greedy": rows}, indent=2))
        return 0
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("per-token thread CPU outside decode, the goal on a 262k vocabulary: <= 500 us for the default chain")
    overhead = [overhead_report(Path(m), args.n_gen, args.repeat) for m in args.models]
    if args.stages_only:
        Path(args.out).write_text(json.dumps({"overhead": overhead}, indent=2))
        return 0
    rows = [bench_model(Path(m), args.threads, args.n_gen, args.repeat) for m in args.models]
    head = f"{'model':34} {'native tg':>9} {'greedy':>8} {'chain':>8} {'chain/native':>12} {'chain/greedy':>12} {'dflt/greedy':>11} {'json':>8} {'json/free':>9}"
    print(head)
    for r in rows:
        native = r["llama_bench_tg"]
        print(
            f"{r['model']:34} {native or float('nan'):9.1f} {r['greedy']:8.1f} {r['default_chain']:8.1f} "
            f"{(r['default_chain'] / native) if native else float('nan'):12.2f} {r['default_chain'] / r['greedy']:12.2f} {r['params_default'] / r['greedy']:11.2f} "
            f"{r['chain_json_schema']:8.1f} {r['chain_json_schema'] / r['chain_unconstrained']:9.2f}"
        )
    print("round-by-round ratios, geometric mean (95% interval):")
    for r in rows:
        cells = [f"{label} {m:.3f} ({lo:.3f}-{hi:.3f})" for label, got in r["paired"].items() if got for m, lo, hi in [got]]
        print(f"  {r['model']:34} " + ("  ".join(cells) or "needs --repeat 2 or more"))
    print("the same ratios implied by the engine loop's cost outside decode (thread CPU, free of the")
    print("machine's drift between rounds): 1 / (1 + (chain's - greedy's us a token) x greedy tok/s / 1e6):")
    for r, o in zip(rows, overhead):
        us = {chain: per["outside decode"] for chain, per in o["engine_us"].items()}
        r["implied"] = {label: 1 / (1 + (us[chain] - us["greedy"]) * r["greedy"] / 1e6)
                        for label, chain in (("chain/greedy", "default+rep1.1"), ("dflt/greedy", "default"))}
        print(f"  {r['model']:34} " + "  ".join(f"{label} {v:.3f}" for label, v in r["implied"].items()))
    Path(args.out).write_text(json.dumps({"decode": rows, "overhead": overhead}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

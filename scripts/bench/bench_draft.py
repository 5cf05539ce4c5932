#!/usr/bin/env python3
"""Speculative decoding with a draft model (issue 53): decode tok/s of Qwen2.5-Coder-1.5B
drafted for by Qwen2.5-Coder-0.5B, in localrun and in native llama-server, and what
localrun's pricing predicts from this machine's measured costs.

    python -m scripts.bench.bench_draft --quick             # 1 repeat, 64 tokens, greedy only (~1.5 min on a quiet 2-core CPU)
    python -m scripts.bench.bench_draft                     # 3 repeats, 160 tokens, + one sampled config
    python -m scripts.bench.bench_draft --engines lr_plain lr_draft --json draft.json

(from the repository's root, as every script under scripts/bench/).

Engines (the same threads, n_ctx, and flash attention as localrun chose it):
  lr_plain / lr_lookup        localrun's 1.5B alone (the same engine, its draft model detached), lookup off / on
  lr_draft / lr_lookup_draft  localrun's 1.5B with the 0.5B loaded (--draft), lookup off / on
  ls_plain / ls_draft         llama-server (scripts/build_llama_tools.sh), plain / with `-md DRAFT
                              --spec-type draft-simple --spec-draft-n-max N`, through /completion
                              with token ids and cache_prompt off (the command lines are printed)

Configurations: a code edit (lookup_tasks' "edit", whose answer copies the prompt) and an
open chat ("bicycle", where lookup finds nothing), greedy; unless --quick or --no-sampled,
the edit again at temperature 0.7, fixed seed. All engines live in this process (servers as
children) and take turns run by run, in an order rotating each repeat, so that load from
other processes falls on all alike. Every run starts from empty KV caches (the draft
model's too, whose prompt localrun reads inside decode, as a first request pays it).
decode tok/s: tokens after the first over the time from the first to the last. Ratios are
paired (scripts/lookup/common.paired_ratio: each repeat's ratio, geometric mean, 95%
interval). Then the measured costs (delta: a draft step over a target one-row step; c(r):
an r-row target step over a one-row one) and `predicted_speedup` at a few acceptance odds,
here and in a GPU-like regime (delta 0.1, a row costing 0.02 of a one-row step).
"""

from __future__ import annotations

import argparse, json, os, statistics, sys, tempfile, time, urllib.request
from collections import Counter
from pathlib import Path

from localrun.speculation.draft_model import DRAFT_MAX, DraftModelProposer, predicted_speedup
from scripts.bench.bench_lookup import LlamaServer, _strip_stop, llama_server_path
from scripts.fetch_test_models import QWEN_CODER, QWEN_CODER_15B, cache_dir
from scripts.lookup.common import WARM_TOKENS, no_model_files, paired_ratio
from scripts.lookup.lookup_tasks import TASKS, task_prompts

ENGINES = ["lr_plain", "lr_draft", "lr_lookup_draft", "lr_lookup", "ls_plain", "ls_draft"]
LR_DRAFTERS = ("lr_draft", "lr_lookup_draft")  # localrun engines whose draft model's offers are counted
RATIOS = {"lrD/lr": ("lr_draft", "lr_plain"), "lrLD/lr": ("lr_lookup_draft", "lr_plain"),
          "lrL/lr": ("lr_lookup", "lr_plain"), "lsD/ls": ("ls_draft", "ls_plain"), "lrD/lsD": ("lr_draft", "ls_draft")}
COUNTS = ("drafted", "accepted", "model_asked", "model_judged", "model_accepted")  # summed over a row's runs
SAMPLED_TEMP, SEED = 0.7, 1234
ODDS = (0.6, 0.8, 0.9)
GPU_DELTA, GPU_PER_ROW = 0.1, 0.02  # a draft step / a row of a wide step, in one-row target steps


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(cache_dir() / QWEN_CODER_15B))
    ap.add_argument("--draft", default=str(cache_dir() / QWEN_CODER))
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=["edit", "bicycle"],
                    help="greedy configurations; the sampled one takes the first task")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=ENGINES)
    ap.add_argument("--repeat", type=int, help="timed runs per engine and configuration (default 3; --quick: 1)")
    ap.add_argument("--max-tokens", type=int, help="tokens per answer (default 160; --quick: 64)")
    ap.add_argument("--sampled", action=argparse.BooleanOptionalAction,
                    help=f"also the first task at temperature {SAMPLED_TEMP}, seed {SEED} (default: on; --quick: off)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--draft-max", type=int, default=DRAFT_MAX, help="localrun's most drafted tokens a step")
    ap.add_argument("--server-draft-max", type=int, default=8, help="llama-server's --spec-draft-n-max")
    ap.add_argument("--llama-server", help="llama-server binary (default: the one build_llama_tools.sh builds)")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 64 tokens, greedy only, unless given otherwise")
    ap.add_argument("--json", metavar="FILE", help="save the rows, runs and costs here")
    args = ap.parse_args(argv)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.max_tokens = args.max_tokens or (64 if args.quick else 160)
    args.sampled = (not args.quick) if args.sampled is None else args.sampled
    return args


def configs(args) -> list[tuple[str, str, float]]:
    """(label, task, temperature) of every timed configuration."""
    out = [(t, t, 0.0) for t in args.tasks]
    return out + ([(f"{args.tasks[0]}@t{SAMPLED_TEMP}", args.tasks[0], SAMPLED_TEMP)] if args.sampled else [])


def localrun_runner(eng, lookup: bool, stops, with_draft: bool):
    """Runs on `eng`, whose draft model is detached for the run unless `with_draft`."""
    from localrun.sampling import SamplingParams

    def run(prompt, n_max, temp):
        model = eng.speculator.draft_model
        for b in (eng.backend, model.backend):
            for s in range(b.n_seq):
                b.kv_clear(s)  # no prefix reuse: every run reads its prompt in full, the draft model's too
        eng.speculator.draft_model = model if with_draft else None
        try:
            return measured(prompt, n_max, temp)
        finally:
            eng.speculator.draft_model = model

    def measured(prompt, n_max, temp):
        # started and stepped here rather than through complete(): the proposer's offers are counted
        gen = eng.start(prompt, sampling=SamplingParams(temperature=temp, seed=SEED), max_tokens=n_max, lookup=lookup)
        parts = getattr(gen.proposer, "proposers", (gen.proposer,))
        drafter = next((p for p in parts if isinstance(p, DraftModelProposer)), None)
        # the draft model's own count (with lookup on, Timings mixes both proposers' tokens):
        # steps it was asked to draft (widths lists only those it drafted for), tokens judged, kept
        seen = Counter()
        if drafter is not None:
            def draft(*a, _draft=drafter.draft):
                seen["asked"] += 1
                return _draft(*a)

            def record(judged, kept, _record=drafter.record):
                seen["judged"] += judged
                seen["kept"] += kept
                _record(judged, kept)
            drafter.draft, drafter.record = draft, record
        tokens = []
        try:
            while not gen.done:
                ev = eng.step([gen]).get(gen.seq)
                if gen.error is not None:
                    raise gen.error
                tokens += ev.tokens if ev is not None else []
        finally:
            eng.release(gen)
        t = gen.timings
        return {"tokens": _strip_stop(tokens, stops), "decode_tps": t.decode_tps or None, "drafted": t.drafted,
                "accepted": t.accepted, "model_asked": seen["asked"], "model_judged": seen["judged"],
                "model_accepted": seen["kept"], "widths": list(drafter.widths) if drafter else []}
    return run


def server_runner(srv: LlamaServer, stops):
    def run(prompt, n_max, temp):
        # llama-server's and localrun's sampler defaults, spelt out: the same chain in both
        body = {"prompt": prompt, "n_predict": n_max, "temperature": temp, "top_k": 40 if temp else 1,
                "top_p": 0.95, "min_p": 0.05, "seed": SEED, "cache_prompt": False, "return_tokens": True}
        req = urllib.request.Request(srv.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            out = json.load(r)
        t = out.get("timings", {})
        return {"tokens": _strip_stop(out.get("tokens", []), stops), "decode_tps": t.get("predicted_per_second"),
                "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0)}
    return run


def summarize(runs: dict) -> list[dict]:
    """runs: config label -> engine -> per-repeat run dicts -> one row per configuration."""
    rows = []
    for label, by in runs.items():
        tps = {e: statistics.median([x["decode_tps"] for x in rs if x["decode_tps"]] or [0]) or None
               for e, rs in by.items()}
        ratios = {}
        for k, (a, b) in RATIOS.items():
            if a in by and b in by:
                num, den = [x["decode_tps"] for x in by[a]], [x["decode_tps"] for x in by[b]]
                one = num[0] / den[0] if len(num) == 1 and num[0] and den[0] else None
                ratios[k] = paired_ratio(num, den) or (one and (one, one, one))
        drafts = {}
        for e, rs in by.items():
            d = {k: sum(x.get(k) or 0 for x in rs) for k in COUNTS}
            d["runs"], d["widths"] = len(rs), dict(sorted(Counter(w for x in rs for w in x.get("widths", [])).items()))
            drafts[e] = d
        plain = by.get("lr_plain", [{}])[0].get("tokens")
        differ = [e for e, rs in by.items() if plain is not None and rs[0]["tokens"] != plain]
        rows.append({"config": label, "decode_tps": tps, "ratios": ratios, "drafts": drafts, "differ": differ,
                     "tps_runs": {e: [x["decode_tps"] for x in rs] for e, rs in by.items()}})
    return rows


def _r(x) -> str:
    return "-" if not x else f"{x[0]:.2f}" if x[1] == x[2] else f"{x[0]:.2f} ({x[1]:.2f}-{x[2]:.2f})"


def format_table(rows: list[dict], repeat: int) -> str:
    shown = [e for e in ENGINES if e in rows[0]["decode_tps"]]
    cols = [k for k, (a, b) in RATIOS.items() if a in shown and b in shown]
    out = [f"decode tok/s, median of {repeat} (lr = localrun, ls = llama-server)",
           f"{'config':<14}" + "".join(f"{e:>16}" for e in shown)]
    out += [f"{r['config']:<14}" + "".join(f"{r['decode_tps'][e] or 0:>16.2f}" for e in shown) for r in rows]
    out += ["", "paired ratios of decode tok/s (D draft, L lookup; >1: the first is faster)",
            f"{'config':<14}" + "".join(f"{k:>19}" for k in cols)]
    out += [f"{r['config']:<14}" + "".join(f"{_r(r['ratios'].get(k)):>19}" for k in cols) for r in rows]
    out += ["", "drafts per run: accepted/drafted (all proposers); the draft model's own kept/judged tokens, the "
            "steps it was asked, and the widths it offered -> count (0: declined after drafting; the rest "
            "of the steps it was asked it declined at once)"]
    for r in rows:
        for e, d in r["drafts"].items():
            if e in LR_DRAFTERS or e == "ls_draft":
                n = d["runs"]
                acc = f"{d['accepted'] / d['drafted']:.2f}" if d["drafted"] else "-"
                own = (f"  model {d['model_accepted'] / n:.0f}/{d['model_judged'] / n:.0f}, asked "
                       f"{d['model_asked'] / n:.0f}" if e in LR_DRAFTERS else "")
                wid = f"  widths {d['widths']}" if e in LR_DRAFTERS else ""
                out.append(f"{r['config']:<14}{e:<16} {d['accepted'] / n:.0f}/{d['drafted'] / n:.0f} "
                           f"(acceptance {acc}){own}{wid}")
    out += [f"{r['config']}: text differs from lr_plain's in {', '.join(r['differ'])}" for r in rows if r["differ"]]
    return "\n".join(out)


def gpu_costs(most: int, per_row: float = GPU_PER_ROW) -> list[float]:
    """c(r) = 1 + per_row (r - 1) for r in 0..most+1 (index 0 unused): a step reading the
    weights once, whatever its rows, as on a GPU or Apple silicon at a small batch."""
    return [1.0 + per_row * max(r - 1, 0) for r in range(most + 2)]


def format_costs(draft_ms, one_row_ms, delta: float, costs: list[float], most: int) -> str:
    """The measured prices and predicted_speedup at ODDS, here and in a GPU-like regime."""
    ms = [("-" if x is None else f"{x:.1f} ms") for x in (draft_ms, one_row_ms)]
    out = [f"measured: draft step {ms[0]}, target one-row step {ms[1]}, delta {delta:.3f}; "
           + ", ".join(f"c({r}) {costs[r]:.2f}" for r in (2, 4, 8) if r < len(costs))]
    for name, c, d in (("this machine", costs, delta), (f"GPU-like (delta {GPU_DELTA}, c(r) = 1 + {GPU_PER_ROW}(r-1))",
                                                         gpu_costs(most), GPU_DELTA)):
        cells = [f"odds {a}: k={k} x{s:.2f}" for a in ODDS for k, s in [predicted_speedup(a, c, d, most)]]
        out.append(f"predicted_speedup, {name}: " + "; ".join(cells))
    return "\n".join(out)


def timed_runs(engines: dict, prompts: dict, cfgs, args) -> dict:
    for run in engines.values():  # warm-up: weights paged in, buffers sized, the draft priced by use
        run(prompts[cfgs[0][1]], WARM_TOKENS, 0.0)
    runs = {c[0]: {e: [] for e in engines} for c in cfgs}
    order = list(engines)
    for r in range(args.repeat):
        for label, task, temp in cfgs:
            k = r % len(order)  # rotate: each engine takes each place in turn, so drift falls on all alike
            for e in order[k:] + order[:k]:
                runs[label][e].append(engines[e](prompts[task], args.max_tokens, temp))
            print(f"  repeat {r + 1} {label:<14}" + "".join(f" {e} {runs[label][e][-1]['decode_tps'] or 0:.1f}"
                                                          for e in order), file=sys.stderr, flush=True)
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    from localrun.engine import Engine
    server = llama_server_path(args.llama_server) if any(e.startswith("ls_") for e in args.engines) else None
    if server and not os.access(server, os.X_OK):
        print(f"error: no llama-server at {server}: bash scripts/build_llama_tools.sh, or --engines", file=sys.stderr)
        return 2
    if no_model_files([Path(args.target), Path(args.draft)]):
        return 2
    t0, load0 = time.time(), os.getloadavg()
    opened, servers, engines = [], [], {}
    try:
        # ONE localrun engine: the plain runs detach its draft model. With two engines of the
        # 1.5B in one process, the one opened second decoded faster: the drafting engine
        # opened first ran 0.95-0.96x the plain one after the first of 5 alternating rounds,
        # opened second 0.99-1.02x (lookup off, where it declines every draft), and this
        # benchmark read that as a cost of the draft model (lrD/lr 0.92-0.96).
        drafting = Engine.open(args.target, n_ctx=args.n_ctx, threads=args.threads, draft=args.draft,
                               draft_max=args.draft_max)
        opened.append(drafting)
        ref = drafting
        prompts, stops, flash = task_prompts(ref, set(args.tasks)), set(ref.info.stop_ids), ref.backend.flash_attn
        log_dir = Path(tempfile.mkdtemp(prefix="bench_draft_"))
        spec = {"ls_plain": [], "ls_draft": ["-md", args.draft, "--spec-type", "draft-simple",
                                             "--spec-draft-n-max", str(args.server_draft_max)]}
        for e in args.engines:
            if e.startswith("lr_"):
                engines[e] = localrun_runner(drafting, "lookup" in e, stops, with_draft="draft" in e)
            else:
                srv = LlamaServer(str(server), args.target, args.threads, args.n_ctx, flash, spec[e],
                                  log_dir / f"{e}.log")
                print(f"# {e}: {' '.join(srv.cmd)} --port PORT", file=sys.stderr, flush=True)
                servers.append(srv)
                srv.start()
                engines[e] = server_runner(srv, stops)
        cfgs = configs(args)
        print(f"# {len(cfgs)} configs x {args.repeat} repeats, up to {args.max_tokens} tokens, threads {args.threads}",
              file=sys.stderr, flush=True)
        runs = timed_runs(engines, prompts, cfgs, args)
        dm, sc = drafting.draft_model, drafting.speculator.step_cost
        cost = {"draft_ms": dm._step_ms, "one_row_ms": sc.one_row_ms(), "delta": dm.step_delta(sc),
                "costs": sc.ratios(dm.draft_max + 1, 0.25), "most": dm.draft_max}
    finally:
        for srv in servers:
            srv.close()
        for eng in opened:
            eng.close()
    rows = summarize(runs)
    print("\n" + format_table(rows, args.repeat))
    if cost:
        print("\n" + format_costs(**cost))
    print(f"\nthreads {args.threads}, n_ctx {args.n_ctx}; load average (1 min) {load0[0]:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end; {time.time() - t0:.0f}s")
    if max(load0[0], os.getloadavg()[0]) > (os.cpu_count() or 1):
        # seen here: with other work on both cores, llama.cpp's threads spin at their barriers
        # and one run decodes 10-50x slower than the next; such outliers are load, not engines
        print("warning: the load exceeded the cores: some runs may have lost the CPU (see the repeats above)")
    if args.json:
        saved = {"args": vars(args), "rows": rows, "costs": cost, "server_logs": str(log_dir),
                 "loadavg": [load0, os.getloadavg()]}
        Path(args.json).write_text(json.dumps(saved, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

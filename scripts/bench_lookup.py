#!/usr/bin/env python3
"""Prompt-lookup speculative decoding: localrun with and without lookup, against
llama-cpp-python's `Llama` with and without `LlamaPromptLookupDecoding`. Greedy.

    python scripts/bench_lookup.py --quick          # smollm2 only, 1 repeat, 64 tokens
    python scripts/bench_lookup.py                  # both test models, 3 repeats, 160 tokens

Input-grounded tasks (rename a variable, fix typos, quote sentences) make the output
copy the prompt, which is where lookup pays; open-ended chat is the control, where it
must not cost much. Instruct models get their chat template; a base model (no template)
gets a raw prompt that it continues by copying. Each model runs in a fresh process
holding all four engines (the same libllama underneath); they alternate run by run in
a rotating order, so that load from other processes drifts onto all of them alike.
decode tok/s for every engine = tokens after the first (an end-of-turn token included)
/ time from the first token to the last, as localrun's Timings count it.
"""

from __future__ import annotations

import argparse, json, math, os, statistics, subprocess, sys, time
from pathlib import Path

MARK = "BENCH_LOOKUP "
MODELS_DIR = Path(os.environ.get("LOCALRUN_TEST_MODELS", "~/.cache/localrun/test-models")).expanduser()
MODELS = ["smollm2-135m-instruct-q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"]

CODE = '''def summarize_requests(lines, window_s=60, slow_ms=500):
    """Aggregate access-log lines into per-endpoint statistics."""
    stats = {}
    errors = []
    first_ts = None
    last_ts = None
    for raw in lines:
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        parts = raw.split(" ")
        if len(parts) < 5:
            errors.append(("short", raw))
            continue
        entry = {
            "ts": float(parts[0]),
            "method": parts[1],
            "path": parts[2].split("?")[0],
            "status": int(parts[3]),
            "ms": float(parts[4]),
        }
        if first_ts is None:
            first_ts = entry["ts"]
        last_ts = entry["ts"]
        if entry["ts"] - first_ts > window_s:
            break
        key = (entry["method"], entry["path"])
        bucket = stats.setdefault(key, {
            "count": 0, "errors": 0, "slow": 0, "total_ms": 0.0, "max_ms": 0.0, "samples": [],
        })
        bucket["count"] += 1
        bucket["total_ms"] += entry["ms"]
        bucket["samples"].append(entry["ms"])
        if entry["ms"] > bucket["max_ms"]:
            bucket["max_ms"] = entry["ms"]
        if entry["status"] >= 500:
            bucket["errors"] += 1
            errors.append(("server", entry))
        elif entry["status"] >= 400:
            errors.append(("client", entry))
        if entry["ms"] >= slow_ms:
            bucket["slow"] += 1
    report = []
    for (method, path), bucket in sorted(stats.items()):
        samples = sorted(bucket["samples"])
        p95 = samples[min(len(samples) - 1, int(len(samples) * 0.95))]
        report.append({
            "endpoint": f"{method} {path}",
            "count": bucket["count"],
            "mean_ms": bucket["total_ms"] / bucket["count"],
            "p95_ms": p95,
            "max_ms": bucket["max_ms"],
            "error_rate": bucket["errors"] / bucket["count"],
            "slow": bucket["slow"],
        })
    span = (last_ts - first_ts) if first_ts is not None else 0.0
    return {"span_s": span, "endpoints": report, "errors": errors}'''

# ~125 words, 8 typos: thier, wich, arive, colege, vistors, beautful, beleive, untill.
TYPOS = (
    "The old harbour town wakes up slowly in the winter. Fishermen check thier nets before dawn, while the bakery on "
    "the corner starts its ovens and the smell of fresh bread, wich drifts down to the water, fills the empty "
    "streets. By eight o'clock the first buses arive from the valley, bringing students to the colege on the hill. "
    "Most vistors come in summer, when the beaches are crowded and every cafe has a queue, but the locals prefer the "
    "quiet months. They say the light is softer, the sea is more beautful, and the walks along the cliffs are empty "
    "enough to hear the birds. In the evening the lighthouse keeper turns on the lamp, and the whole town seems to "
    "beleive it is safe untill morning.")

# ~190 words; exactly two sentences mention copper.
SOURCE = (
    "The village of Arlen sits at the end of a narrow valley, three hours by road from the nearest city. For most of "
    "its history it lived from sheep and from the small orchards that climb the southern slope. In 1871 a surveyor "
    "found copper in the rocks above the church, and within ten years the population had doubled. The mine brought a "
    "railway, a school and a doctor, but it also brought smoke that killed the pear trees along the river. Families "
    "who had farmed the same fields for generations sold their land to the company and moved into rows of brick "
    "houses near the shafts. When the price of copper collapsed after the war, the company closed the mine in a "
    "single week. The railway stopped running soon after, and the young people left for the coast. Today Arlen has "
    "fewer than four hundred residents. The brick houses have been repainted in bright colours and rented to hikers, "
    "the orchards have been replanted, and an old engine house has become a small museum where visitors can see the "
    "tools, the maps and the letters of the miners who once lived there.")

# name -> (group, chat message for instruct models, raw prompt for base models)
TASKS = {
    "rename": ("grounded",
               f"Rename the variable `entry` to `record` in this Python function. Reply with the whole "
               f"rewritten function and nothing else.\n\n```python\n{CODE}\n```",
               f"Original:\n```python\n{CODE}\n```\n\nSame code with the variable `entry` renamed to "
               f"`record`:\n```python\n"),
    "typos": ("grounded",
              f"Fix the spelling mistakes in this paragraph. Reply with the corrected paragraph only.\n\n{TYPOS}",
              f"Text with typos:\n{TYPOS}\n\nSame text with the typos fixed:\n"),
    "quote": ("grounded",
              f"{SOURCE}\n\nQuote, word for word, the two sentences of this text that mention copper.",
              f"Text:\n{SOURCE}\n\nThe two sentences of the text that mention copper, quoted verbatim:\n1. \""),
    "poem": ("chat", "Write a short poem about the sea.", "Q: Write a short poem about the sea.\nA:"),
    "bicycle": ("chat", "Explain how a bicycle works.", "Q: Explain how a bicycle works.\nA:"),
    "trip": ("chat", "Give me three ideas for a weekend trip.", "Q: Give me three ideas for a weekend trip.\nA:"),
}


# -- worker: one fresh process per model -----------------------------------------------

def work(job):
    import numpy as np
    from llama_cpp import Llama, __version__ as lcpp_version
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from localrun.backends.base import BatchEntry
    from localrun.engine import Engine
    from localrun.sampling import SamplingParams

    eng = Engine.open(job["model"], n_ctx=job["n_ctx"], threads=job["threads"])
    chat = eng.info.chat_template is not None  # a base model has none: raw prompts
    prompts = {n: eng.chat_prompt([{"role": "user", "content": TASKS[n][1]}]) if chat
               else eng.tokenize(TASKS[n][2]) for n in job["tasks"]}
    stops, greedy = eng.info.stop_ids, SamplingParams(temperature=0.0)

    def localrun(lookup):
        def run(prompt, n_max):
            res = eng.complete(prompt, sampling=greedy, max_tokens=n_max, lookup=lookup)
            t = res.timings
            return {"tokens": res.tokens, "finish": res.finish_reason, "decode_tps": t.decode_tps,
                    "generated": t.generated_tokens, "steps": t.steps, "drafted": t.drafted, "accepted": t.accepted}
        return run

    def llama_cpp(draft):
        # logits_all must be passed with a draft model: Llama sizes its score buffer by the
        # argument (n_batch rows otherwise) while a draft model makes it store every row, so a
        # prompt longer than n_batch overflows it ("could not broadcast ... into shape (0,)").
        # The plain baseline keeps logits_all off: storing every row would slow it down.
        llm = Llama(job["model"], n_ctx=job["n_ctx"], n_threads=job["threads"], n_threads_batch=job["threads"],
                    flash_attn=True, draft_model=draft, logits_all=draft is not None, verbose=False)

        def run(prompt, n_max):
            llm.reset()  # no prefix reuse from the previous run: every run prefills in full
            toks, times = [], []
            gen = llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0)
            for tok in gen:  # generate() never stops by itself: EOS and length are ours
                times.append(time.perf_counter())
                if tok in stops:
                    break
                toks.append(int(tok))
                if len(toks) >= n_max:
                    break
            gen.close()
            dt = times[-1] - times[0] if len(times) > 1 else 0.0
            return {"tokens": toks, "decode_tps": (len(times) - 1) / dt if dt > 0 else None}
        return run

    engines = {"lr_lookup": localrun(True), "lr_plain": localrun(False),
               "lcpp_lookup": llama_cpp(LlamaPromptLookupDecoding(num_pred_tokens=10)), "lcpp_plain": llama_cpp(None)}
    for run in engines.values():  # warm-up: page weights in, size compute buffers for k+1 rows
        run(prompts[job["tasks"][0]], 16)
    # All four alternate run by run, and the order rotates each repeat, so that load from
    # other processes drifts onto every engine alike rather than onto whichever ran last.
    runs = {n: {e: [] for e in engines} for n in job["tasks"]}
    order = list(engines)
    for r in range(job["repeat"]):
        for n in job["tasks"]:
            for e in order[r % 4:] + order[:r % 4]:
                runs[n][e].append(engines[e](prompts[n], job["max_tokens"]))
            print(f"  repeat {r + 1} {n:<8}" + "".join(f" {e} {_f(runs[n][e][-1]['decode_tps'], '.1f')}"
                                                      for e in order), file=sys.stderr, flush=True)

    def gap_at(prompt, out, lk, i):
        """Replay the no-lookup run exactly (prefill in n_batch chunks, then one token per
        decode, as Engine.step does) to read the logits row that chose token i."""
        be, pos = eng.backend, 0
        be.kv_clear(0)
        while pos < len(prompt):
            chunk = prompt[pos:pos + be.n_batch]
            rows = be.decode([BatchEntry(0, chunk, pos, int(pos + len(chunk) == len(prompt)))])
            pos += len(chunk)
        for t in out[:i]:
            rows = be.decode([BatchEntry(0, [t], pos, 1)])
            pos += 1
        row = np.array(rows[0][-1])
        be.kv_clear(0)
        a, b = (int(x) for x in np.argsort(row)[-2:][::-1])
        want = out[i] if i < len(out) else None  # None: the no-lookup run stopped here
        got = lk[i] if i < len(lk) else None
        return {"top1": a, "top2": b, "top2_gap": float(row[a] - row[b]),
                "replay_matches": a == want or (want is None and a in stops),
                "lookup_token": got, "lookup_token_is_top2": got == b}

    diffs, stable = {}, {}
    for n in job["tasks"]:
        a, b = runs[n]["lr_plain"][0]["tokens"], runs[n]["lr_lookup"][0]["tokens"]
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            diffs[n] = {"index": i, **gap_at(prompts[n], a, b, i)}
        stable[n] = all(x["tokens"] == rs[0]["tokens"] for rs in runs[n].values() for x in rs)
    text = {n: eng.detokenize(runs[n]["lr_lookup"][0]["tokens"]) for n in job["tasks"]}
    eng.close()
    return {"chat_template": chat, "llama_cpp_python": lcpp_version, "prompt_tokens": {n: len(p) for n, p in prompts.items()},
            "runs": runs, "diffs": diffs, "stable_across_repeats": stable, "text_lookup": text}


def spawn(job):
    """Run the worker in a fresh interpreter; its result is the one MARK line on stdout."""
    p = subprocess.run([sys.executable, __file__, "--worker"], input=json.dumps(job),
                       stdout=subprocess.PIPE, text=True, timeout=3600)  # stderr: progress, passed through
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"worker failed (rc {p.returncode}); its stderr is above")


# -- driver ------------------------------------------------------------------------------

def _geo(xs):  # geometric mean: the right average of speed ratios
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def bench_model(path, args, tasks):
    w = spawn({"model": str(path), "n_ctx": 4096, "threads": args.threads, "tasks": tasks,
               "max_tokens": args.max_tokens, "repeat": args.repeat})
    rows = []
    for n in tasks:
        runs, d = w["runs"][n], w["diffs"].get(n)
        tps = {e: statistics.median([x["decode_tps"] for x in rs if x["decode_tps"]] or [0]) or None
               for e, rs in runs.items()}
        ratio = lambda a, b: tps[a] / tps[b] if tps[a] and tps[b] else None  # noqa: E731
        on = runs["lr_lookup"]
        drafted = sum(x["drafted"] for x in on)
        rows.append({
            "model": path.name, "task": n, "group": TASKS[n][0], "prompt_tokens": w["prompt_tokens"][n],
            "generated": on[0]["generated"], "finish": on[0]["finish"], "decode_tps": tps,
            "speedup_lookup": ratio("lr_lookup", "lr_plain"),
            "speedup_vs_lcpp_lookup": ratio("lr_lookup", "lcpp_lookup"),
            "lcpp_lookup_speedup": ratio("lcpp_lookup", "lcpp_plain"),
            "acceptance": sum(x["accepted"] for x in on) / drafted if drafted else None,
            "tokens_per_step": sum(x["generated"] for x in on) / max(1, sum(x["steps"] for x in on)),
            "identical": d is None, "first_diff": d, "stable_across_repeats": w["stable_across_repeats"][n],
            "lcpp_lookup_identical_to_plain": runs["lcpp_lookup"][0]["tokens"] == runs["lcpp_plain"][0]["tokens"],
            "lr_identical_to_lcpp": runs["lr_plain"][0]["tokens"] == runs["lcpp_plain"][0]["tokens"],
            "tps_runs": {e: [x["decode_tps"] for x in rs] for e, rs in runs.items()},
            "text_lookup": w["text_lookup"][n]})
    return rows, {"chat_template": w["chat_template"], "llama_cpp_python": w["llama_cpp_python"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS, help="file names in $LOCALRUN_TEST_MODELS, or paths")
    ap.add_argument("--tasks", choices=["grounded", "chat", "all"], default="all")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="smollm2 only, 1 repeat, 64 tokens")
    ap.add_argument("--out", default="bench-lookup.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(MARK + json.dumps(work(json.load(sys.stdin))), flush=True)
        return 0
    if args.quick:
        args.models, args.repeat, args.max_tokens = MODELS[:1], 1, 64
    tasks = [n for n, t in TASKS.items() if args.tasks in ("all", t[0])]
    load0, t0 = os.getloadavg(), time.time()
    rows, meta = [], {}
    for m in args.models:
        path = Path(m) if Path(m).exists() else MODELS_DIR / m
        print(f"# {path.name}: {len(tasks)} tasks x {args.repeat} repeats, up to {args.max_tokens} tokens",
              file=sys.stderr, flush=True)
        r, meta[path.name] = bench_model(path, args, tasks)
        rows += r
        # saved after every model, so that a long run that dies late still leaves its rows
        Path(args.out).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if k != "worker"}, "meta": meta,
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "rows": rows}, indent=1))

    hdr = (f"{'model':<32}{'task':<8}{'prompt':>7}{'gen':>5} | {'lr-LU':>6}{'lr':>6}{'lcpLU':>6}{'lcp':>6} | "
           f"{'LU/lr':>6}{'lr/lcpLU':>9}{'lcpLU/lcp':>10} | {'acc':>5}{'tok/st':>7}  same")
    print(f"\ndecode tok/s, median of {args.repeat}; threads={args.threads}; LU = prompt lookup; "
          f"lr = localrun, lcp = llama-cpp-python\n{hdr}\n" + "-" * len(hdr))
    for r in rows:
        t, d = r["decode_tps"], r["first_diff"]
        same = "yes" if r["identical"] else f"no @{d['index']} (gap {d['top2_gap']:.3f})"
        print(f"{r['model']:<32}{r['task']:<8}{r['prompt_tokens']:>7}{r['generated']:>5} | "
              + "".join(f"{_f(t[e], '.1f'):>6}" for e in ("lr_lookup", "lr_plain", "lcpp_lookup", "lcpp_plain"))
              + f" | {_f(r['speedup_lookup']):>6}{_f(r['speedup_vs_lcpp_lookup']):>9}{_f(r['lcpp_lookup_speedup']):>10}"
              f" | {_f(r['acceptance']):>5}{r['tokens_per_step']:>7.2f}  {same}")
    summary = {}
    print("\ngeometric means over tasks            LU/lr  lr-LU/lcpLU  lcpLU/lcp")
    for m in dict.fromkeys(r["model"] for r in rows):
        for g in ("grounded", "chat"):
            sel = [r for r in rows if r["model"] == m and r["group"] == g]
            if sel:
                s = summary[f"{m}/{g}"] = {k: _geo([r[k] for r in sel]) for k in
                                           ("speedup_lookup", "speedup_vs_lcpp_lookup", "lcpp_lookup_speedup")}
                print(f"  {m:<32}{g:<9}{_f(s['speedup_lookup']):>6}{_f(s['speedup_vs_lcpp_lookup']):>12}"
                      f"{_f(s['lcpp_lookup_speedup']):>11}")
    flips = [r for r in rows if not r["identical"]]
    print(f"\nlocalrun lookup output differs from no-lookup in {len(flips)} of {len(rows)} rows")
    for r in flips:
        d = r["first_diff"]
        print(f"  {r['model']} {r['task']}: first diff at token {d['index']}; no-lookup top-2 logit gap "
              f"{d['top2_gap']:.4f}; lookup took the runner-up: {d['lookup_token_is_top2']}; "
              f"replay reproduced the no-lookup token: {d['replay_matches']}")
    unstable = [f"{r['model']}/{r['task']}" for r in rows if not r["stable_across_repeats"]]
    print(f"outputs that changed between repeats: {unstable or 'none'}\n"
          f"load average (1 min) {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; {time.time() - t0:.0f}s")
    data = json.loads(Path(args.out).read_text())
    Path(args.out).write_text(json.dumps({**data, "summary": summary}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

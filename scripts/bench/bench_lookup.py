#!/usr/bin/env python3
"""Prompt-lookup speculative decoding, greedy: localrun with and without lookup, against
native llama-server's own n-gram speculation and llama-cpp-python's
`LlamaPromptLookupDecoding`, in the same run on the same prompt tokens.

    python -m scripts.bench.bench_lookup --quick            # smollm2 only, 1 repeat, 64 tokens
    python -m scripts.bench.bench_lookup                    # all three test models, 3 repeats, 160 tokens
    python -m scripts.bench.bench_lookup --identity-only    # only: same text with lookup on and off?
    python -m scripts.bench.bench_lookup --models gemma qwen --engines lr_lookup lr_plain ls_simple ls_plain

(from the repository's root, as every script under scripts/bench/).

Engines (all greedy: temperature 0, top_k 1, the same threads, n_ctx, and flash attention
as localrun's backend chose it for this machine and cache, see backends/attention.py):
  lr_lookup / lr_plain      localrun's Engine with lookup on / off
  lr_exact                  lookup with LookupConfig(exact_greedy=True): a wide row's greedy
                            token only where it leads by more than the measured batch drift
                            (not in the default set; it prints what that rule costs and buys)
  lr_noedit                 lookup with LookupConfig(learn_edits=False): drafts copy the source
                            as it stands, not with the edits the answer made to it (not in the
                            default set; it prints what learning edits buys)
  ls_simple / ls_mod / ls_plain
                            llama-server (scripts/build_llama_tools.sh builds it from the
                            llama.cpp that llama-cpp-python vendors) with `--spec-type
                            ngram-simple`, `--spec-type ngram-mod` (their default draft
                            settings) and without speculation, driven through /completion
                            with the prompt as token ids and cache_prompt off
  lcpp_lookup / lcpp_plain  llama-cpp-python's `Llama` with and without LlamaPromptLookupDecoding

Tasks (scripts/lookup/lookup_tasks.py): grounded ones whose answer copies the prompt (two code
edits, typo fixes, quoting), where lookup pays, and open-ended chat, the control where it
must not cost. Instruct models get their chat template, a base model a raw prompt.

Each model runs in a fresh process holding every engine (llama-server as child
processes); engines alternate run by run in a rotating order, so that load from other
processes drifts onto all of them alike. decode tok/s = tokens after the first (an
end-of-turn token included) / time from the first token to the last: localrun's Timings,
llama-server's timings.predicted_per_second and our clock around llama-cpp-python all count
it so. Every run starts from an empty KV cache. llama-server's ngram-mod keeps one n-gram
hash for the life of the process, so a repeated prompt would draft from the previous
answer; its server is restarted before every timed run to measure a first request, as
localrun's lookup (which remembers nothing between requests) is measured.

Identity: over the tasks plus a few short prompts (12 in all), whether lookup on gives the
same tokens as lookup off, for localrun and for llama-server (as a reference), and where
localrun's first differ, the no-lookup top-2 logit gap there.
"""

from __future__ import annotations

import argparse, json, os, signal, statistics, subprocess, sys, tempfile, time, urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

from scripts.lookup.common import (MODELS, WARM_TOKENS, first_diff, geo_mean, no_model_files, paired_ratio,
                                   resolve_model)
from scripts.lookup.lookup_tasks import TASKS, task_prompts
from tests.serving import free_port

REPO = Path(__file__).resolve().parents[2]
MARK = "BENCH_LOOKUP "
ENGINES = ["lr_lookup", "lr_exact", "lr_noedit", "lr_plain", "ls_simple", "ls_mod", "ls_plain", "lcpp_lookup", "lcpp_plain"]
DEFAULT_ENGINES = [e for e in ENGINES if e not in ("lr_exact", "lr_noedit")]
SERVER_SPEC = {"ls_plain": [], "ls_simple": ["--spec-type", "ngram-simple"], "ls_mod": ["--spec-type", "ngram-mod"]}
# (label, lookup-on engine, lookup-off engine) whose texts the identity check compares
IDENTITY_PAIRS = [("localrun", "lr_lookup", "lr_plain"), ("localrun-exact", "lr_exact", "lr_plain"),
                  ("ngram-simple", "ls_simple", "ls_plain"),
                  ("ngram-mod", "ls_mod", "ls_plain"), ("lr-off=server-none", "lr_plain", "ls_plain")]
SERVER_START_S = 300  # a loaded 2-core machine can take minutes to map and warm a model


def llama_server_path(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    ver = metadata.version("llama-cpp-python")
    tools = Path(os.environ.get("LOCALRUN_TOOLS", Path.home() / ".cache/localrun/tools"))
    return tools / f"llama.cpp-{ver}" / "build" / "bin" / "llama-server"


class LlamaServer:
    """One native llama-server process on a free localhost port, restartable."""

    def __init__(self, binary: str, model: str, threads: int, n_ctx: int, flash_attn: str, spec: list[str],
                 log: Path):
        self.cmd = [binary, "-m", model, "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
                    "-c", str(n_ctx), "-np", "1", "-fa", flash_attn, "--cache-ram", "0", "--no-webui", *spec]
        self.log, self.proc, self.url = log, None, ""

    def start(self) -> None:
        port = free_port()  # the tiny race with another process for it is acceptable here
        self.url = f"http://127.0.0.1:{port}"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd + ["--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not become healthy in {SERVER_START_S}s; see {self.log}")

    def restart(self) -> None:
        self.close()
        self.start()

    def complete(self, prompt: list[int], n_max: int) -> dict:
        body = {"prompt": prompt, "n_predict": n_max, "temperature": 0.0, "top_k": 1, "seed": 0,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            return json.load(r)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the worker dies, however it dies, so
    that a killed benchmark leaves no llama-server holding a model and a port."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _strip_stop(tokens, stops) -> list[int]:
    """Engines differ in whether the end-of-turn token is part of the answer; it never is here."""
    toks = [int(t) for t in tokens]
    return toks[:-1] if toks and toks[-1] in stops else toks


# -- worker: one fresh process per model -----------------------------------------------

def make_engines(job, eng, stops, servers, log_dir):
    """engine name -> run(prompt, n_max, timed) -> {"tokens", "decode_tps", ...}."""
    from localrun.sampling import SamplingParams
    from localrun.speculation.lookup import LookupConfig
    greedy = SamplingParams(temperature=0.0)
    flash_attn = eng.backend.flash_attn  # "on" / "off" / "auto": every engine attends the same way

    def localrun(lookup):
        def run(prompt, n_max, timed=True):
            eng.backend.kv_clear(0)  # no prefix reuse: every engine prefills in full, from the same state
            res = eng.complete(prompt, sampling=greedy, max_tokens=n_max, lookup=lookup)
            t = res.timings
            return {"tokens": _strip_stop(res.tokens, stops), "finish": res.finish_reason, "decode_tps": t.decode_tps,
                    "generated": t.generated_tokens, "steps": t.steps, "drafted": t.drafted, "accepted": t.accepted}
        return run

    def llama_server(name):
        srv = LlamaServer(job["server"], job["model"], job["threads"], job["n_ctx"], flash_attn,
                          SERVER_SPEC[name], log_dir / f"{name}.log")
        servers.append(srv)
        srv.start()

        def run(prompt, n_max, timed=True):
            if timed and name == "ls_mod":
                srv.restart()  # an empty n-gram hash: no drafting from the previous run's answer
            r = srv.complete(prompt, n_max)
            t = r.get("timings", {})
            return {"tokens": _strip_stop(r.get("tokens", []), stops), "finish": r.get("stop_type"),
                    "decode_tps": t.get("predicted_per_second") or None, "generated": t.get("predicted_n"),
                    "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0)}
        return run

    def llama_cpp(lookup):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
        # logits_all must be passed with a draft model: Llama sizes its score buffer by the
        # argument (n_batch rows otherwise) while a draft model makes it store every row, so a
        # prompt longer than n_batch overflows it ("could not broadcast ... into shape (0,)").
        # The plain baseline keeps logits_all off: storing every row would slow it down.
        llm = Llama(job["model"], n_ctx=job["n_ctx"], n_threads=job["threads"], n_threads_batch=job["threads"],
                    flash_attn=flash_attn != "off", draft_model=draft, logits_all=draft is not None, verbose=False)

        def run(prompt, n_max, timed=True):
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

    makers = {"lr_lookup": lambda: localrun(True), "lr_exact": lambda: localrun(LookupConfig(exact_greedy=True)),
              "lr_noedit": lambda: localrun(LookupConfig(learn_edits=False)),
              "lr_plain": lambda: localrun(False),
              "ls_simple": lambda: llama_server("ls_simple"), "ls_mod": lambda: llama_server("ls_mod"),
              "ls_plain": lambda: llama_server("ls_plain"),
              "lcpp_lookup": lambda: llama_cpp(True), "lcpp_plain": lambda: llama_cpp(False)}
    return {e: makers[e]() for e in job["engines"]}


def work(job):
    from localrun.engine import Engine

    eng = Engine.open(job["model"], n_ctx=job["n_ctx"], threads=job["threads"])
    chat = eng.info.chat_template is not None  # a base model has none: raw prompts
    prompts = task_prompts(eng)
    stops = set(eng.info.stop_ids)
    servers: list[LlamaServer] = []
    log_dir = Path(tempfile.mkdtemp(prefix="bench_lookup_"))
    try:
        engines = make_engines(job, eng, stops, servers, log_dir)
        tasks = [] if job["identity_only"] else job["tasks"]
        if "lr_exact" in engines:
            measure_batch_drift(eng, prompts)
        runs = timed_runs(job, engines, prompts, tasks)
        identity, diffs = identity_runs(job, eng, engines, prompts, runs, stops)
    finally:
        for srv in servers:
            srv.close()
    text = {n: eng.detokenize(identity[n]["lr_lookup"]) for n in identity if "lr_lookup" in identity[n]}
    eng.close()
    stable = {n: all(x["tokens"] == rs[0]["tokens"] for rs in runs[n].values() for x in rs) for n in runs}
    return {"chat_template": chat, "prompt_tokens": {n: len(p) for n, p in prompts.items()}, "runs": runs,
            "identity": identity, "diffs": diffs, "stable_across_repeats": stable, "text_lookup": text,
            "server_logs": str(log_dir)}


def measure_batch_drift(eng, prompts):
    """With exact_greedy, localrun measures a model's batch drift on its first speculative
    steps (recomputing them one row at a time) and keeps it in the cache folder: a user pays
    that once per model. Pay it here, untimed, so that timed runs show the speed every
    later run has."""
    from localrun.sampling import SamplingParams
    from localrun.speculation.lookup import LookupConfig

    for name in ("edit", "rename", *prompts):
        if not eng.speculator.drift.calibrating:
            break
        eng.complete(prompts[name], sampling=SamplingParams(temperature=0.0), max_tokens=128,
                     lookup=LookupConfig(exact_greedy=True))
    print(f"  batch drift: {eng.speculator.drift.worst:.3f} (a wide step's greedy token needs a lead over "
          f"{eng.speculator.drift.margin:.3f})", file=sys.stderr, flush=True)


def timed_runs(job, engines, prompts, tasks):
    if not tasks:
        return {}
    for run in engines.values():  # warm-up: page weights in, size compute buffers for k+1 rows
        run(prompts[tasks[0]], WARM_TOKENS, timed=False)
    # All engines alternate run by run, and the order rotates each repeat, so that load from
    # other processes drifts onto every engine alike rather than onto whichever ran last.
    runs = {n: {e: [] for e in engines} for n in tasks}
    order = list(engines)
    for r in range(job["repeat"]):
        for n in tasks:
            k = r % len(order)
            for e in order[k:] + order[:k]:
                runs[n][e].append(engines[e](prompts[n], job["max_tokens"]))
            print(f"  repeat {r + 1} {n:<8}" + "".join(f" {e} {_f(runs[n][e][-1]['decode_tps'], '.1f')}"
                                                      for e in order), file=sys.stderr, flush=True)
    return runs


def identity_runs(job, eng, engines, prompts, runs, stops):
    """Tokens of every identity engine on every prompt (a timed run's first repeat where
    there is one, else one untimed run), and for localrun's differences the replayed
    no-lookup logits at the first differing token."""
    import numpy as np
    from localrun.backends.base import BatchEntry

    which = [e for e in ("lr_lookup", "lr_exact", "lr_plain", "ls_plain", "ls_simple", "ls_mod") if e in engines]
    out = {}
    for n, prompt in prompts.items():
        out[n] = {e: runs[n][e][0]["tokens"] if n in runs else engines[e](prompt, job["max_tokens"], timed=False)["tokens"]
                  for e in which}
        print(f"  identity {n:<9}" + "".join(f" {e} {len(t)}" for e, t in out[n].items()), file=sys.stderr, flush=True)

    def gap_at(prompt, plain, lk, i):
        """Replay the no-lookup run exactly (the prompt but its last token in n_batch
        chunks, then one token per decode from that last token on, as Engine.step does)
        to read the logits row that chose token i."""
        be, pos = eng.backend, 0
        be.kv_clear(0)
        while pos < len(prompt) - 1:
            chunk = prompt[pos:min(pos + be.n_batch, len(prompt) - 1)]
            be.decode([BatchEntry(0, chunk, pos, 0)])
            pos += len(chunk)
        rows = be.decode([BatchEntry(0, [prompt[-1]], pos, 1)])
        pos += 1
        for t in plain[:i]:
            rows = be.decode([BatchEntry(0, [t], pos, 1)])
            pos += 1
        row = np.array(rows[0][-1])
        be.kv_clear(0)
        a, b = (int(x) for x in np.argsort(row)[-2:][::-1])
        want = plain[i] if i < len(plain) else None  # None: the no-lookup run stopped here
        got = lk[i] if i < len(lk) else None
        return {"top1": a, "top2": b, "top2_gap": float(row[a] - row[b]),
                "replay_matches": a == want or (want is None and a in stops),
                "lookup_token": got, "lookup_token_is_top2": got == b}

    diffs = {}
    if "lr_lookup" in which and "lr_plain" in which:
        for n, toks in out.items():
            i = first_diff(toks["lr_plain"], toks["lr_lookup"])
            if i is not None:
                diffs[n] = {"index": i, **gap_at(prompts[n], toks["lr_plain"], toks["lr_lookup"], i)}
    return out, diffs


def spawn(job):
    """Run the worker in a fresh interpreter; its result is the one MARK line on stdout."""
    p = subprocess.run([sys.executable, "-m", "scripts.bench.bench_lookup", "--worker"], cwd=REPO,
                       input=json.dumps(job), stdout=subprocess.PIPE, text=True,
                       timeout=4 * 3600)  # stderr: progress, passed through
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"worker failed (rc {p.returncode}); its stderr is above")


# -- driver ------------------------------------------------------------------------------

def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


# ratio column -> (numerator engine, denominator engine)
RATIOS = {"LU/off": ("lr_lookup", "lr_plain"), "LU/simple": ("lr_lookup", "ls_simple"),
          "LU/mod": ("lr_lookup", "ls_mod"), "LU/lcpLU": ("lr_lookup", "lcpp_lookup"),
          "LU/exact": ("lr_lookup", "lr_exact"), "LU/noedit": ("lr_lookup", "lr_noedit"),
          # localrun's plain decode over llama-server's on the same kernels: on a copy that
          # both engines keep whole the lookup ratio LU/simple is this times the plans' ratio
          "off/none": ("lr_plain", "ls_plain"),
          "simple/none": ("ls_simple", "ls_plain"), "mod/none": ("ls_mod", "ls_plain"),
          "lcpLU/lcp": ("lcpp_lookup", "lcpp_plain")}
DRAFTERS = ("lr_lookup", "lr_exact", "lr_noedit", "ls_simple", "ls_mod")  # engines that report drafted / accepted tokens


def task_rows(label, w, tasks):
    rows = []
    for n in tasks:
        runs = w["runs"][n]
        tps = {e: statistics.median([x["decode_tps"] for x in rs if x["decode_tps"]] or [0]) or None
               for e, rs in runs.items()}
        ratios = {k: tps[a] / tps[b] if tps.get(a) and tps.get(b) else None for k, (a, b) in RATIOS.items()}
        paired = {k: paired_ratio([x["decode_tps"] for x in runs[a]], [x["decode_tps"] for x in runs[b]])
                  for k, (a, b) in RATIOS.items() if a in runs and b in runs}
        drafts = {e: (sum(x["accepted"] for x in runs[e]) / len(runs[e]), sum(x["drafted"] for x in runs[e]) / len(runs[e]))
                  for e in DRAFTERS if e in runs}
        on = runs.get("lr_lookup")
        rows.append({
            "model": label, "task": n, "group": TASKS[n][0], "prompt_tokens": w["prompt_tokens"][n],
            "generated": len(next(iter(runs.values()))[0]["tokens"]), "decode_tps": tps, "ratios": ratios,
            "paired": paired,
            "drafts_per_run": drafts,
            "lr_tokens_per_step": sum(x["generated"] for x in on) / max(1, sum(x["steps"] for x in on)) if on else None,
            "stable_across_repeats": w["stable_across_repeats"][n],
            # the identity check found lookup's answer not lookup off's (a near-tie that wide
            # steps, through their rows or the KV they wrote, broke the other way): the
            # engines then decoded different texts, and their speeds compare less
            "lookup_changed_text": n in w["diffs"] if "lr_lookup" in runs and "lr_plain" in runs else None,
            "tps_runs": {e: [x["decode_tps"] for x in rs] for e, rs in runs.items()},
            "text_lookup": w["text_lookup"].get(n)})
    return rows


def identity_summary(w):
    """label -> {"same": k, "of": n, "diffs": {prompt: first differing index}}."""
    out = {}
    for label, on, off in IDENTITY_PAIRS:
        sel = {n: t for n, t in w["identity"].items() if on in t and off in t}
        if sel:
            d = {n: first_diff(t[off], t[on]) for n, t in sel.items()}
            out[label] = {"same": sum(i is None for i in d.values()), "of": len(sel),
                          "diffs": {n: i for n, i in d.items() if i is not None}}
    return out


def print_tables(rows, args, engines):
    shown = [e for e in ENGINES if e in engines]
    hdr = f"{'model':<9}{'task':<8}{'prompt':>7}{'gen':>5} |" + "".join(f"{e:>12}" for e in shown)
    hdr += " | " + "".join(f"{'a/d ' + e.split('_')[1]:>11}" for e in DRAFTERS if e in engines)
    print(f"\ndecode tok/s, median of {args.repeat}; threads={args.threads}; lr = localrun, ls = llama-server, "
          f"lcpp = llama-cpp-python; a/d = accepted/drafted tokens per run\n{hdr}\n" + "-" * len(hdr))
    for r in rows:
        t, d = r["decode_tps"], r["drafts_per_run"]
        print(f"{r['model']:<9}{r['task']:<8}{r['prompt_tokens']:>7}{r['generated']:>5} |"
              + "".join(f"{_f(t.get(e), '.1f'):>12}" for e in shown) + " | "
              + "".join(f"{'%.0f/%.0f' % d[e]:>11}" for e in DRAFTERS if e in d))
    cols = [k for k, (a, b) in RATIOS.items() if a in engines and b in engines]
    hdr = f"{'model':<9}{'task':<14}" + "".join(f"{k:>12}" for k in cols)
    print(f"\nratios of decode tok/s (LU = localrun lookup; >1: the first is faster; (text): lookup's answer "
          f"differs from lookup off's, so the engines decoded different texts)\n{hdr}\n" + "-" * len(hdr))
    for r in rows:
        task = r["task"] + (" (text)" if r["lookup_changed_text"] else "")
        print(f"{r['model']:<9}{task:<14}" + "".join(f"{_f(r['ratios'][k]):>12}" for k in cols))
    summary = {}
    for m in dict.fromkeys(r["model"] for r in rows):
        for g in ("grounded", "chat"):
            sel = [r for r in rows if r["model"] == m and r["group"] == g]
            if sel:
                s = summary[f"{m}/{g}"] = {k: geo_mean([r["ratios"][k] for r in sel]) for k in cols}
                print(f"{m:<9}{'geo ' + g:<14}" + "".join(f"{_f(s[k]):>12}" for k in cols))
    paired = [k for k in cols if any(r["paired"].get(k) for r in rows)]
    if paired:
        hdr = f"{'model':<9}{'task':<14}" + "".join(f"{k:>20}" for k in paired)
        print(f"\npaired ratios: geometric mean of each repeat's ratio (the engines ran back to back), with "
              f"its 95% interval\n{hdr}\n" + "-" * len(hdr))
        for r in rows:
            cells = [r["paired"].get(k) for k in paired]
            task = r["task"] + (" (text)" if r["lookup_changed_text"] else "")
            print(f"{r['model']:<9}{task:<14}"
                  + "".join(f"{'-' if c is None else '%.2f (%.2f-%.2f)' % c:>20}" for c in cells))
    return summary


def print_identity(ident, workers, max_tokens):
    print(f"\nidentity at temperature 0: the same tokens with lookup on and off (up to {max_tokens} tokens each)")
    for m, s in ident.items():
        print(f"  identity {m}: " + "   ".join(f"{lab} {v['same']}/{v['of']}" for lab, v in s.items()))
        for lab, v in s.items():
            if v["diffs"] and lab != "lr-off=server-none":
                print(f"    {lab} first differs at: " + ", ".join(f"{n}@{i}" for n, i in v["diffs"].items()))
        for n, d in workers[m]["diffs"].items():
            print(f"    localrun {n}@{d['index']}: no-lookup top-2 logit gap {d['top2_gap']:.4f}; lookup took "
                  f"the runner-up: {d['lookup_token_is_top2']}; replay reproduced the no-lookup token: "
                  f"{d['replay_matches']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", help=f"short names {list(MODELS)}, file names in "
                    "$LOCALRUN_TEST_MODELS, or paths (default: all three; --quick: smollm2)")
    ap.add_argument("--tasks", choices=["grounded", "chat", "all"], default="all")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=DEFAULT_ENGINES)
    ap.add_argument("--max-tokens", type=int, help="tokens per answer (default 160; --quick: 64)")
    ap.add_argument("--repeat", type=int, help="timed runs per engine and task (default 3; --quick: 1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="smollm2, 1 repeat, 64 tokens, unless given otherwise")
    ap.add_argument("--identity-only", action="store_true",
                    help="no timing: the identity check only, with localrun and llama-server")
    ap.add_argument("--llama-server", help="llama-server binary (default: the one build_llama_tools.sh builds)")
    ap.add_argument("--out", default="bench-lookup.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: the worker's finally stops its servers, subprocess.run
    # kills the worker.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.worker:
        print(MARK + json.dumps(work(json.load(sys.stdin))), flush=True)
        return 0
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.max_tokens = args.max_tokens or (64 if args.quick else 160)
    models = args.models or (["smollm2"] if args.quick else list(MODELS))
    engines = [e for e in ENGINES if e in args.engines and not (args.identity_only and e.startswith("lcpp"))]
    server = None
    if any(e.startswith("ls_") for e in engines):
        server = llama_server_path(args.llama_server)
        if not os.access(server, os.X_OK):
            print(f"error: no llama-server at {server}: build it with `bash scripts/build_llama_tools.sh`, "
                  f"pass --llama-server PATH, or leave the ls_* engines out with --engines", file=sys.stderr)
            return 2
    resolved = [resolve_model(m) for m in models]
    if no_model_files(p for _, p in resolved):
        return 2
    tasks = [n for n, t in TASKS.items() if args.tasks in ("all", t[0])]
    load0, t0 = os.getloadavg(), time.time()
    rows, workers, ident = [], {}, {}
    for label, path in resolved:
        what = "identity only" if args.identity_only else f"{len(tasks)} tasks x {args.repeat} repeats"
        print(f"# {label} ({path.name}): {what}, up to {args.max_tokens} tokens, engines {' '.join(engines)}",
              file=sys.stderr, flush=True)
        w = workers[label] = spawn({
            "model": str(path.resolve()), "n_ctx": 4096, "threads": args.threads, "tasks": tasks, "engines": engines,
            "max_tokens": args.max_tokens, "repeat": args.repeat, "server": str(server.resolve()) if server else None,
            "identity_only": args.identity_only})
        rows += task_rows(label, w, tasks if not args.identity_only else [])
        ident[label] = identity_summary(w)
        # saved after every model, so that a long run that dies late still leaves its rows
        Path(args.out).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if k != "worker"}, "engines": engines,
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "rows": rows, "identity": ident,
            "workers": {m: {k: v for k, v in x.items() if k not in ("runs", "identity")} for m, x in workers.items()},
        }, indent=1))
    summary = print_tables(rows, args, engines) if rows else {}
    print_identity(ident, workers, args.max_tokens)
    unstable = [f"{r['model']}/{r['task']}" for r in rows if not r["stable_across_repeats"]]
    print(f"outputs that changed between repeats: {unstable or 'none'}\n"
          f"load average (1 min) {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; {time.time() - t0:.0f}s")
    data = json.loads(Path(args.out).read_text())
    Path(args.out).write_text(json.dumps({**data, "summary": summary}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

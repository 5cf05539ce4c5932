#!/usr/bin/env python3
"""What a proposer (a draft model, or prompt lookup) costs or gains a step, measured
inside each answer (issues 53 and 52).

    python -m scripts.bench.draft_steps                 # Qwen2.5-Coder-1.5B with its 0.5B, edit and bicycle, greedy and t0.7
    python -m scripts.bench.draft_steps --proposer lookup --tasks poem trip bicycle --answers 8   # SmolLM2's lookup
    python -m scripts.bench.draft_steps --tasks bicycle --answers 6 --max-tokens 128

(from the repository's root, as every script under scripts/bench/).

bench_draft and bench_lookup time whole answers with and without the proposer, one after
the other; on this 2-core machine two answers of the same work differ by up to ~10% with
the load of the moment, which hides a cost of a few percent either way. Here one
generation asks its proposer on every other step only (the other steps skip it, as a
generation without one does), and each step's time and tokens go to its arm, so the load
falls on both arms alike within milliseconds. The ratio is tokens per second of the
asked steps over the skipped ones: under 1 what asking costs (the proposer declined, or
drafted and lost), over 1 what its drafts gained (then the arms' steps differ in what
they follow: a kept draft's tokens are the skipped step's history too). --proposer draft
runs with prompt lookup off; --proposer lookup has no draft model.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from scripts.bench.bench_draft import SAMPLED_TEMP, SEED
from scripts.fetch_test_models import QWEN_CODER, QWEN_CODER_15B, SMOLLM2, cache_dir
from scripts.lookup.common import no_model_files
from scripts.lookup.lookup_tasks import TASKS, task_prompts


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proposer", choices=["draft", "lookup"], default="draft")
    ap.add_argument("--target", help=f"the model (default: {QWEN_CODER_15B} for draft, {SMOLLM2} for lookup)")
    ap.add_argument("--draft", default=str(cache_dir() / QWEN_CODER))
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=["edit", "bicycle"])
    ap.add_argument("--temps", nargs="+", type=float, default=[0.0, SAMPLED_TEMP])
    ap.add_argument("--answers", type=int, default=4, help="answers per task and temperature")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-ctx", type=int, default=4096)
    args = ap.parse_args(argv)
    args.target = args.target or str(cache_dir() / (QWEN_CODER_15B if args.proposer == "draft" else SMOLLM2))
    return args


def arm_ratio(asked: list[tuple[float, int]], skipped: list[tuple[float, int]]) -> dict:
    """(seconds, tokens) of each step of the two arms -> both arms' tokens per second and
    their ratio, asked over skipped, with a 95% interval from the per-step spread (the
    steps' times are independent draws of each arm's step time; tokens per step are 1
    unless a draft was kept)."""
    def rate(steps):
        secs, toks = sum(s for s, _ in steps), sum(t for _, t in steps)
        return toks / secs if secs else 0.0

    a, s = rate(asked), rate(skipped)
    out = {"asked_tps": a, "skipped_tps": s, "ratio": a / s if s else None, "steps": (len(asked), len(skipped))}
    if len(asked) > 1 and len(skipped) > 1 and a and s:
        # the log of each arm's mean step time, by the delta method
        err = math.sqrt(sum(statistics.variance([x for x, _ in st]) / len(st) / statistics.fmean([x for x, _ in st]) ** 2
                            for st in (asked, skipped)))
        out["interval"] = (out["ratio"] * math.exp(-1.96 * err), out["ratio"] * math.exp(1.96 * err))
    return out


def one_answer(eng, prompt, temp: float, max_tokens: int, asked: list, skipped: list) -> None:
    """One answer whose proposer is asked on even steps only; its steps into the arms.
    With a draft model loaded, it is the proposer (lookup off); else prompt lookup is."""
    from localrun.sampling import SamplingParams

    drafting = eng.draft_model is not None
    for b in (eng.backend, *([eng.draft_model.backend] if drafting else [])):
        for seq in range(b.n_seq):
            b.kv_clear(seq)
    gen = eng.start(prompt, sampling=SamplingParams(temperature=temp, seed=SEED), max_tokens=max_tokens,
                    lookup=not drafting)
    drafter = gen.proposer
    assert drafter is not None, "no proposer: the draft model took no slot"
    real, step = drafter.draft, 0

    def draft(*a):
        return real(*a) if step % 2 == 0 else []

    drafter.draft = draft
    try:
        while not gen.done:
            was_decoding = gen.decoding
            t0 = time.perf_counter()
            ev = eng.step([gen]).get(gen.seq)
            took = time.perf_counter() - t0
            if was_decoding and ev is not None and ev.tokens:  # a prompt-reading step is neither arm's
                (asked if step % 2 == 0 else skipped).append((took, len(ev.tokens)))
                step += 1
    finally:
        eng.release(gen)


def main(argv=None) -> int:
    args = parse_args(argv)
    if no_model_files([Path(args.target)] + ([Path(args.draft)] if args.proposer == "draft" else [])):
        return 2
    from localrun.engine import Engine

    draft = args.draft if args.proposer == "draft" else None
    with Engine.open(args.target, n_ctx=args.n_ctx, threads=args.threads, draft=draft) as eng:
        prompts = task_prompts(eng, set(args.tasks))
        print(f"{'task':<10}{'temp':>6}{'asked tok/s':>14}{'skipped tok/s':>15}{'ratio':>8}  95% interval   steps")
        for task in args.tasks:
            for temp in args.temps:
                asked, skipped = [], []
                for _ in range(args.answers):
                    one_answer(eng, prompts[task], temp, args.max_tokens, asked, skipped)
                r = arm_ratio(asked, skipped)
                lo, hi = r.get("interval", (float("nan"), float("nan")))
                print(f"{task:<10}{temp:>6.1f}{r['asked_tps']:>14.2f}{r['skipped_tps']:>15.2f}{r['ratio']:>8.3f}"
                      f"  {lo:.3f}-{hi:.3f}   {r['steps'][0]}/{r['steps'][1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

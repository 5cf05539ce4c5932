"""Does a real draft model change what the target says? (issue 53)

On this CPU the draft model's measured prices decline every draft (bench_draft.py), so
here its prices are forced to a GPU's (a draft step 0.1 of a target step, a row 0.02):
it then drafts on every step, which is what exactness must survive.

1. Identity at temperature 0, over every prompt of scripts/lookup/lookup_tasks.py: the
   answer with the draft model attached against the same engine's answer with it
   detached, token for token, under the exact_greedy guard and without it. With the
   fast kernels (the default) a wide step's rows and the KV it writes drift from a
   one-row step's by up to ~0.2-0.35 logits here, which may flip a near tie later in the
   answer: the guard re-checks the rows, not the KV of kept drafts (drift.py), so this is
   a rate, as prompt lookup's is. `--kernels identical` loads the target with the weights
   in their stored layout and flash attention on, where rows of up to 6 drafts are
   bit-identical to one-row rows: there every answer must be the same.
2. The law under sampling: the first --tokens tokens at temperature 1 for --seeds seeds
   with drafts and as many other seeds without; a two-sample chi-square over the
   sequences (those seen fewer than 5 times pooled) must not reject at 1%.

    .venv/bin/python -m scripts.bench.draft_exactness             # 1.5B target, 0.5B draft
    .venv/bin/python -m scripts.bench.draft_exactness --seeds 300 --max-tokens 48
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

from localrun.backends.attention import FLASH_ATTN_ENV
from scripts.bench.bench_draft import GPU_DELTA, GPU_PER_ROW, gpu_costs
from scripts.fetch_test_models import QWEN_CODER, QWEN_CODER_15B, cache_dir
from scripts.lookup.common import no_model_files
from scripts.lookup.lookup_tasks import task_prompts

POOL_BELOW = 5  # sequences seen fewer times (in both samples together) share one cell


def homogeneity(a: Counter, b: Counter) -> tuple[float, int, float]:
    """(chi-square, degrees of freedom, p-value) that two samples of outcomes share one law."""
    rare = {k for k in a.keys() | b.keys() if a[k] + b[k] < POOL_BELOW}
    cells = [(a[k], b[k]) for k in a.keys() | b.keys() if k not in rare]
    pooled = (sum(a[k] for k in rare), sum(b[k] for k in rare))
    if sum(pooled):
        cells.append(pooled)
    na, nb = sum(x for x, _ in cells), sum(y for _, y in cells)
    stat = 0.0
    for x, y in cells:
        both = x + y
        for seen, n in ((x, na), (y, nb)):
            expected = both * n / (na + nb)
            stat += (seen - expected) ** 2 / expected
    dof = max(len(cells) - 1, 1)
    return stat, dof, chi2_survival(stat, dof)


def chi2_survival(x: float, k: int) -> float:
    """P(X >= x) for chi-square with k degrees of freedom (Wilson-Hilferty: close enough
    to reject at 1% or not; no scipy here)."""
    if x <= 0:
        return 1.0
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def force_gpu_prices(engine) -> None:
    engine.speculator.step_cost.ratios = lambda most, prior=0.25: gpu_costs(most)[: most + 1]
    engine.draft_model.step_delta = lambda cost: GPU_DELTA
    engine.draft_model.read_delta = lambda cost: 0.0


def answer(engine, prompt, sampling, n, lookup, drafting: bool):
    model = engine.speculator.draft_model
    engine.speculator.draft_model = model if drafting else None
    try:
        return engine.complete(prompt, sampling=sampling, max_tokens=n, lookup=lookup)
    finally:
        engine.speculator.draft_model = model


def identity(engine, args) -> bool:
    from localrun.request import LookupConfig
    from localrun.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    guards = {"exact_greedy": LookupConfig(enabled=False, exact_greedy=True), "unguarded": LookupConfig(enabled=False)}
    prompts = task_prompts(engine)
    same = Counter()
    for name, prompt in prompts.items():
        plain = answer(engine, prompt, greedy, args.max_tokens, guards["unguarded"], drafting=False).tokens
        for guard, lookup in guards.items():
            got = answer(engine, prompt, greedy, args.max_tokens, lookup, drafting=True)
            same[guard] += got.tokens == plain
            print(f"  {name:<10} {guard:<13} {'same' if got.tokens == plain else 'DIFFERS'}"
                  f"  kept {got.timings.accepted}/{got.timings.drafted} drafted", flush=True)
    for guard in guards:
        print(f"identity at temperature 0, {guard}: {same[guard]}/{len(prompts)} prompts")
    return args.kernels == "fast" or same["exact_greedy"] == len(prompts)


def law(engine, args) -> bool:
    from localrun.request import LookupConfig
    from localrun.sampling import SamplingParams

    prompt = engine.chat_prompt([{"role": "user", "content": "Name one animal and say why you like it."}])
    samples, drafted, kept = {True: Counter(), False: Counter()}, 0, 0
    for seed in range(args.seeds):
        for drafting in (True, False):
            sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                      seed=seed + (0 if drafting else args.seeds))  # independent samples
            got = answer(engine, prompt, sampling, args.tokens, LookupConfig(enabled=False), drafting)
            samples[drafting][tuple(got.tokens)] += 1
            if drafting:
                drafted, kept = drafted + got.timings.drafted, kept + got.timings.accepted
    stat, dof, p = homogeneity(samples[True], samples[False])
    print(f"law at temperature 1: {args.seeds} seeds each, first {args.tokens} tokens, "
          f"{len(samples[True] | samples[False])} distinct sequences; drafts kept {kept}/{drafted}; "
          f"chi-square {stat:.1f} on {dof} dof, p = {p:.3f} ({'rejects' if p < 0.01 else 'does not reject'} at 1%)")
    return p >= 0.01 and drafted > 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(cache_dir() / QWEN_CODER_15B))
    ap.add_argument("--draft", default=str(cache_dir() / QWEN_CODER))
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per temperature-0 answer")
    ap.add_argument("--seeds", type=int, default=200, help="seeds per sample under sampling (0: skip)")
    ap.add_argument("--tokens", type=int, default=2, help="tokens per sampled sequence")
    ap.add_argument("--draft-max", type=int, default=6)
    ap.add_argument("--kernels", choices=["fast", "identical"], default="fast",
                    help="identical: stored-layout weights and flash attention on (bit-identical rows, slower)")
    args = ap.parse_args(argv)
    from localrun.engine import Engine

    if no_model_files([Path(args.target), Path(args.draft)]):
        return 2
    start = time.time()
    identical = args.kernels == "identical"
    if identical:
        os.environ[FLASH_ATTN_ENV] = "on"
    with Engine.open(args.target, n_ctx=1024, draft=args.draft, draft_max=args.draft_max,
                     repack=not identical) as engine:
        force_gpu_prices(engine)
        print(f"# {args.target} drafted by {args.draft}, prices forced to a GPU's (delta {GPU_DELTA}, "
              f"a row {GPU_PER_ROW}); {args.kernels} kernels, flash attention {engine.backend.flash_attn}", flush=True)
        ok = identity(engine, args)
        if args.seeds:
            ok = law(engine, args) and ok
    print(f"{time.time() - start:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What prompt lookup costs or saves an answer, step by step: each task answered with lookup
on and with it off, back to back on one engine, and every step of the lookup answer set
against the lookup-off steps over the same positions.

    python -m scripts.lookup.lookup_step_ledger --model smollm2 --tasks chat --pairs 16
    python -m scripts.lookup.lookup_step_ledger --model qwen --tasks trip poem --pairs 12

Why: on a chat, lookup drafts a few times an answer, so its speed differs from lookup off by
a percent or two, while on this project's shared CPU one answer's decode time wanders by
+-10% from one minute to the next. The answers' tok/s ratio (what bench_lookup.py prints)
then needs hundreds of pairs to tell 0.98 from 1.00. But the two answers of a pair, when
their text is the same, run the same one-row step at every position lookup did not touch;
what lookup changes is:

  wide   its speculative steps, against the lookup-off steps over the positions each one
         advanced (a rejected draft advances one position and is paid in full);
  after  the `--after` one-row steps that follow a speculative step (llama.cpp rebuilds its
         compute graph for a new batch shape, and the wide step left other data in the caches);
  outside  the time between decodes (drafting, the acceptance record, the KV trim).

The sum of these per answer (D, in ms) is lookup's cost, with a standard error that comes
from those few steps alone; the one-row steps lookup left alone ("plain") carry the
machine's drift and are printed but not counted. The estimated speed ratio is
T_off / (T_off + D), T_off the mean lookup-off decode time, with a 95% t interval from D's.
Where the two texts part (a near tie that a many-row step decided the other way), the pair
is cut before the lookup step that produced the first differing token: its steps and time
are counted up to there, and the table says how many pairs were cut.
"""

from __future__ import annotations

import argparse, math, statistics, sys, time
from contextlib import contextmanager
from dataclasses import dataclass, field

from scripts.lookup.common import MODELS, WARM_TOKENS, existing_model, first_diff, paired_ratio, t975
from scripts.lookup.lookup_tasks import TASKS, greedy_answer, task_engine

KINDS = ("wide", "after", "plain")


@dataclass(frozen=True)
class Step:
    pos: int  # position of the step's first token
    rows: int  # tokens fed: 1, or 1 + the draft
    ms: float
    end: float  # ms on the process clock when the decode returned


@dataclass
class Ledger:
    """One pair's step times by kind: ms with lookup on, and the lookup-off ms over the
    same positions."""
    on: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    off: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    outside: float = 0.0  # time between decodes, lookup on minus lookup off
    t_off: float = 0.0  # lookup off's decode time over the span compared (ms)
    wide: list[tuple[int, int, int, float, float]] = field(default_factory=list)  # (pos, rows, advanced, on, off ms)

    def delta(self, kind: str) -> float:
        return self.on[kind] - self.off[kind]

    @property
    def cost(self) -> float:
        """D: what lookup added to the answer's decode time (negative: saved)."""
        return self.delta("wide") + self.delta("after") + self.outside


def ledger(on: list[Step], off: list[Step], first_pos: int, after: int, differ: int | None = None) -> Ledger | None:
    """Set the lookup answer's decode steps (those at or past `first_pos`, the position after
    the first token) against the lookup-off steps over the positions each advanced. Both
    lists are in decode order; `off` has one one-row step per position. `differ`: the index
    of the first output token where the two answers part (None: the same text); the
    comparison then ends with the last lookup step before it (None if none is left)."""
    start = {}  # each answer's clock when its first token came (the decode time counts from there)
    for name, steps in (("on", on), ("off", off)):
        before = [s for s in steps if s.pos < first_pos]
        if not before or not any(s.pos >= first_pos for s in steps):
            raise ValueError("an answer without decode steps")
        start[name] = before[-1].end
    on = [s for s in on if s.pos >= first_pos]
    off_by_pos = {s.pos: s for s in off if s.pos >= first_pos}
    end = max(off_by_pos) + 1
    stops = [s.pos for s in on[1:]] + [end]  # where each lookup step's advance ends
    if differ is not None:
        cut = first_pos + differ - 1  # lookup off's step at `cut` produced the first differing token
        kept = sum(1 for stop in stops if stop <= cut)
        if not kept:
            return None
        on, stops, end = on[:kept], stops[:kept], stops[kept - 1]
    off_ms = {p: s.ms for p, s in off_by_pos.items() if p < end}
    out = Ledger()
    out.t_off = off_by_pos[end - 1].end - start["off"]
    out.outside = (on[-1].end - start["on"] - sum(s.ms for s in on)) - (out.t_off - sum(off_ms.values()))
    # positions the first-token step advanced past with a draft: paid in the first token's time
    out.off["wide"] += sum(off_ms.get(p, 0.0) for p in range(first_pos, on[0].pos))
    # one-row steps since the last speculative step (the first token's step may have been one)
    since_wide = 0 if on[0].pos > first_pos else after + 1
    for s, stop in zip(on, stops):
        if s.rows > 1:
            kind, since_wide = "wide", 0
        else:
            since_wide += 1
            kind = "after" if since_wide <= after else "plain"
        paired = sum(off_ms.get(p, 0.0) for p in range(s.pos, stop))
        out.on[kind] += s.ms
        out.off[kind] += paired
        if kind == "wide":
            out.wide.append((s.pos, s.rows, stop - s.pos, s.ms, paired))
    return out


def estimate(costs: list[float], t_off: list[float]) -> tuple[float, float, float] | None:
    """Speed ratio lookup on / off as T_off / (T_off + D) at D's mean and at the ends of its
    95% interval (inf where the interval's low end saves more than T_off), or None under 2
    pairs."""
    if len(costs) < 2:
        return None
    mean, t = statistics.fmean(costs), statistics.fmean(t_off)
    half = t975(len(costs) - 1) * statistics.stdev(costs) / math.sqrt(len(costs))
    return t / (t + mean), t / (t + mean + half), t / (t + mean - half) if t + mean - half > 0 else math.inf


@contextmanager
def recorded(backend, steps: list[Step]):
    """Each decode of one sequence that asks for logits appends its Step to `steps`."""
    decode = backend.decode

    def timed(batch):
        t0 = time.perf_counter()
        rows = decode(batch)
        if len(batch) == 1 and batch[0].n_logits:
            t1 = time.perf_counter()
            steps.append(Step(batch[0].pos, len(batch[0].tokens), (t1 - t0) * 1000, t1 * 1000))
        return rows

    backend.decode = timed
    try:
        yield
    finally:
        del backend.decode  # the class's method again


def _mean_se(xs: list[float]) -> str:
    if len(xs) < 2:
        return "-"
    return f"{statistics.fmean(xs):+7.1f} ±{statistics.stdev(xs) / math.sqrt(len(xs)):5.1f}"


def _ratio(r: tuple[float, float, float] | None) -> str:
    return f"{r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})" if r else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help=f"a short name {list(MODELS)} or a path")
    ap.add_argument("--tasks", nargs="+", default=["chat"],
                    help=f"task names {list(TASKS)}, or `chat`, `grounded`, `all`")
    ap.add_argument("--pairs", type=int, default=16, help="answers with lookup on and off, per task")
    ap.add_argument("--after", type=int, default=2, help="one-row steps after a speculative step counted as its own")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", action="store_true", help="print each speculative step against lookup off's")
    args = ap.parse_args(argv)
    tasks = [n for n in TASKS if n in args.tasks or TASKS[n][0] in args.tasks or "all" in args.tasks]
    unknown = set(args.tasks) - set(TASKS) - {"chat", "grounded", "all"}
    if unknown or not tasks:
        print(f"error: unknown task(s) {sorted(unknown) or args.tasks}; choose from {list(TASKS)}, chat, "
              f"grounded, all", file=sys.stderr)
        return 2
    if args.pairs < 2 or args.max_tokens < 2 or args.after < 0:
        print("error: --pairs and --max-tokens must be at least 2, --after at least 0", file=sys.stderr)
        return 2
    label, path = existing_model(args.model)

    with task_engine(path, args.threads, tasks) as (eng, prompts):

        def answer(name: str, lookup: bool, max_tokens: int = args.max_tokens):
            steps: list[Step] = []
            with recorded(eng.backend, steps):
                res = greedy_answer(eng, prompts[name], lookup, max_tokens)
            return res, steps

        answer(tasks[0], True, WARM_TOKENS)  # weights paged in, buffers sized for wide steps
        answer(tasks[0], False, WARM_TOKENS)
        kept = {n: [] for n in tasks}  # (ledger, first differing token or None, on tok/s, off tok/s)
        for k in range(args.pairs):
            for name in tasks:
                first, second = (True, False) if k % 2 == 0 else (False, True)  # who goes first alternates
                runs = {first: answer(name, first), second: answer(name, second)}
                (on, on_steps), (off, off_steps) = runs[True], runs[False]
                differ = first_diff(list(off.tokens), list(on.tokens))
                # the first token's step fed the prompt's last token: decode steps start after it
                book = ledger(on_steps, off_steps, len(prompts[name]), args.after, differ)
                if book is None:
                    print(f"  pair {k + 1} {name:<8} texts part at token {differ}, before any lookup step: dropped",
                          file=sys.stderr, flush=True)
                    continue
                kept[name].append((book, differ, on.timings.decode_tps, off.timings.decode_tps))
                part = "" if differ is None else f", cut at token {differ}"
                print(f"  pair {k + 1} {name:<8} D {book.cost:+6.1f} ms of {book.t_off:6.0f}{part} (wide "
                      f"{book.delta('wide'):+.1f}, after {book.delta('after'):+.1f}, outside {book.outside:+.1f})  "
                      f"tok/s on {on.timings.decode_tps:5.1f} off {off.timings.decode_tps:5.1f}",
                      file=sys.stderr, flush=True)
                if args.steps:
                    for pos, rows, adv, a, b in book.wide:
                        print(f"      pos {pos:4} rows {rows:2} advanced {adv:2}: {a:6.1f} ms, off {b:6.1f} ms over "
                              f"the same positions", file=sys.stderr, flush=True)

    print(f"\n{label}: lookup on against off, {args.pairs} pairs a task, greedy, {args.max_tokens} tokens, "
          f"threads {args.threads}; ms per answer (a cut pair: up to where its texts part), mean ± standard error; "
          f"the tok/s ratio over same-text pairs only")
    print(f"{'task':<9}{'pairs':>6}{'cut':>4}{'off ms':>8}{'wide':>15}{'after':>15}{'outside':>15}{'D':>15}"
          f"{'plain (drift)':>16}   ratio by D (95%)      ratio by tok/s (95%)")
    for name in tasks:
        rows = kept[name]
        books = [b for b, *_ in rows]
        t_off = [b.t_off for b in books]
        est = estimate([b.cost for b in books], t_off)
        same = [r for r in rows if r[1] is None]
        wall = paired_ratio([r[2] for r in same], [r[3] for r in same])
        print(f"{name:<9}{len(rows):>3}/{args.pairs:<2}{len(rows) - len(same):>4}"
              f"{statistics.fmean(t_off) if t_off else 0:>8.0f}"
              f"{_mean_se([b.delta('wide') for b in books]):>15}{_mean_se([b.delta('after') for b in books]):>15}"
              f"{_mean_se([b.outside for b in books]):>15}{_mean_se([b.cost for b in books]):>15}"
              f"{_mean_se([b.delta('plain') for b in books]):>16}   {_ratio(est):<22}{_ratio(wall)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Why prompt lookup drafted what it drafted: one lookup task on the real engine, traced
decision by decision. The tasks run in scripts/bench/bench_lookup.py's order (its warm-up, then
each task with lookup and again without, `--rounds` times through) on one engine, so the
step costs and the acceptance record it carries are the ones a benchmark run sees (the
benchmark also rotates which engine runs a task first; here lookup always does); the
traced task is the one of the last round.

    python -m scripts.lookup.trace_lookup --model gemma --task edit
    python -m scripts.lookup.trace_lookup --model smollm2 --task bicycle --rounds 1
    python -m scripts.lookup.trace_lookup --model smollm2 --task rename --text
    python -m scripts.lookup.trace_lookup --model smollm2 --task edit --only   # that task alone

For every step of the traced answer where the history's tail matched earlier text: the
match length, its band and acceptance rate, the draft length chosen, and the price the
controller put on a few widths (in one-row steps). For every step the engine timed: its
rows, its ms, the one-row time the step-cost model held for that moment (the machine's
speed as it followed it), and how many drafted tokens it kept.
A run of plain steps without a match prints as one line. With `--text`, each decision
also shows the history's last tokens and the draft as text (where a copy parted from its
source, and which occurrence a match took).

Why: the benchmark's tok/s says that a plan was slow, the replay (scripts/lookup/replay_lookup.py)
what a plan would cost on a quiet machine; this says what the engine believed when it chose,
e.g. a width priced from a slow moment of an earlier answer.
"""

from __future__ import annotations

import argparse, statistics, sys
from contextlib import contextmanager

from scripts.lookup.common import MODELS, WARM_TOKENS, existing_model
from scripts.lookup.lookup_tasks import TASKS, greedy_answer, task_engine

PRICED = (2, 4, 8, 12, 20, 30, 40, 49)  # widths whose price each decision prints


class Tracer:
    """Collects the traced answer's decisions and timed steps as printable lines."""

    def __init__(self, detokenize=None) -> None:
        self.detokenize = detokenize  # with --text: tokens -> str, to show the tail and the draft
        self.on = False
        self.lines: list[str] = []
        self._quiet: list[float] = []  # one-row steps without a match since the last line

    def flush_quiet(self) -> None:
        if self._quiet:
            self.lines.append(f"  {len(self._quiet):3} plain step(s) without a match, median "
                              f"{statistics.median(self._quiet):.1f} ms")
            self._quiet = []

    def decision(self, ctrl, history: list[int], draft: list[int], match: int) -> None:
        from localrun.speculation.lookup import slot_label

        slot = ctrl.priced  # its band, and whether the match is a phrase of the answer's own
        band = slot_label(slot) if slot >= 0 else "-"
        # -: nothing followed the match, or only the chat template's turn marks
        rate = f"{ctrl.rate(slot):.3f}" if slot >= 0 else "-"
        prices = " ".join(f"{w}:{ctrl.row_cost(w):.1f}" for w in PRICED)
        self.flush_quiet()
        self.lines.append(f"  pos {len(history):4}  match {match:2}  band {band:4}  rate {rate:5}  "
                          f"draft {len(draft):2}  | price {prices}")
        if self.detokenize is not None:
            self.lines.append(f"      tail {self.detokenize(history[-12:])!r}  draft {self.detokenize(draft)!r}")

    def step(self, rows: int, ms: float, one_row: float | None, matched: bool) -> None:
        if rows == 1 and not matched:
            self._quiet.append(ms)
            return
        self.flush_quiet()
        ref = f"{one_row:.1f}" if one_row else "-"
        ratio = f"{ms / one_row:.2f}" if one_row else "-"
        self.lines.append(f"    step {rows:2} row(s)  {ms:6.1f} ms  one-row {ref} ms  ratio {ratio}")

    def verdict(self, drafted: int, accepted: int) -> None:
        self.lines[-1] += f"  kept {accepted}/{drafted}"


@contextmanager
def traced(engine, tracer: Tracer):
    """The engine's draft controllers and step-cost record report to `tracer` while
    `tracer.on`."""
    from localrun.speculation.lookup import LookupProposer

    draft, record = LookupProposer.draft, LookupProposer.record
    observe = engine.speculator.step_cost.observe
    matched = [False]  # the step being decoded had a match

    def traced_draft(ctrl, history, room, *share):
        out = draft(ctrl, history, room, *share)
        if tracer.on:
            match = ctrl.match
            matched[0] = match >= ctrl.cfg.min_match
            if matched[0]:
                tracer.decision(ctrl, history, out, match)
        return out

    def traced_record(ctrl, drafted, accepted):
        if tracer.on and drafted:
            tracer.verdict(drafted, accepted)
        return record(ctrl, drafted, accepted)

    def traced_observe(rows, ms, drafting=True):
        if tracer.on:
            tracer.step(rows, ms, engine.speculator.step_cost.one_row_ms(), matched[0])
            matched[0] = False
        return observe(rows, ms, drafting)

    LookupProposer.draft, LookupProposer.record = traced_draft, traced_record
    engine.speculator.step_cost.observe = traced_observe
    try:
        yield
    finally:
        LookupProposer.draft, LookupProposer.record = draft, record
        engine.speculator.step_cost.observe = observe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma", help=f"a short name {list(MODELS)} or a path")
    ap.add_argument("--task", default="edit", choices=list(TASKS))
    ap.add_argument("--rounds", type=int, default=2, help="times through the tasks; the last one's is traced")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--text", action="store_true", help="show each decision's history tail and draft as text")
    ap.add_argument("--only", action="store_true",
                    help="run the warm-up and the traced task only (faster; the step costs and acceptance"
                         " record are then only theirs, not a whole benchmark round's)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 1:
        print("error: --rounds and --max-tokens must be at least 1", file=sys.stderr)
        return 2
    label, path = existing_model(args.model)

    with task_engine(path, args.threads, TASKS) as (eng, prompts):

        def answer(name: str, lookup: bool, max_tokens: int = args.max_tokens):
            return greedy_answer(eng, prompts[name], lookup, max_tokens)

        tracer = Tracer(eng.detokenize if args.text else None)
        print(f"{label}: tasks in bench_lookup.py's order, greedy, {args.max_tokens} tokens, threads {args.threads}")
        with traced(eng, tracer):
            first = next(iter(TASKS))
            answer(first, True, WARM_TOKENS)
            answer(first, False, WARM_TOKENS)
            for r in range(1, args.rounds + 1):
                for name in [args.task] if args.only else TASKS:
                    tracer.on = r == args.rounds and name == args.task
                    on = answer(name, True)
                    tracer.on = False
                    off = answer(name, False)
                    t = on.timings
                    print(f"  round {r} {name:<8} lookup {t.decode_tps:6.1f} tok/s, off {off.timings.decode_tps:6.1f}"
                          f"  x{t.decode_tps / off.timings.decode_tps:.2f}  steps {t.steps:3}  "
                          f"accepted/drafted {t.accepted}/{t.drafted}  "
                          f"{'same text' if list(on.tokens) == list(off.tokens) else 'text differs'}")
        tracer.flush_quiet()
    print(f"\n{args.task}, round {args.rounds}, with lookup: prices in one-row steps; ratio = ms / one-row")
    print("\n".join(tracer.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

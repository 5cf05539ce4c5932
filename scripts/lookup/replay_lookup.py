#!/usr/bin/env python3
"""Prompt lookup's step plans without the machine's noise: each test model's greedy
answers to the lookup tasks are replayed through localrun's draft controller and through
llama-server's ngram-simple rule, and each plan is costed with a table of measured step
times (a step of r rows, over a one-row step's) measured after that task's own prompt: a
step's cost depends on how much context it attends to (SmolLM2's one-row step
takes 18.9 ms after the 293-token edit prompt and 24.5 ms after the 662-token rename
prompt, and 10 rows cost 6.1 and 5.4 one-row steps there), so one table measured after
the longest prompt under-prices wide steps for the shorter ones.

    python -m scripts.lookup.replay_lookup                  # all three test models
    python -m scripts.lookup.replay_lookup --models gemma --max-tokens 160

Why: decode speed on a shared 2-core machine moves by +-15% from run to run, more than
what separates two drafting rules, and where a wide step's row breaks a near-tie the
other way, the answer itself changes (see localrun/speculation/lookup.py, "Temperature 0").
Here every rule drafts against the same answer (the one lookup off gives), the verdict
on a draft is how far it agrees with that answer, and a plan costs the sum of its steps'
measured ratios. So "x" below is what a plan would decode at over lookup off if a step
took exactly its measured time, and two rules' x differ only by their plans.

The controller prices drafts as it does in the engine: with a StepCost it learns online,
each replayed step observed at its task's measured time in ms for its width (so a width
it has not tried yet is priced by the prior, as in a fresh process, and the price of
exploring shows; and the one-row times it compares with lag from one task's position to
the next's, as in the engine).
Between two answers, `--plain-between` one-row steps of a lookup-off answer pass through
the same StepCost, as bench_lookup.py's plain runs share the engine with its lookup runs.

As in the engine, no draft holds the prompts' turn marks (the chat template's control and
end-of-generation tokens, recorded with the answers).

The ngram-simple rule, as llama-server's documentation and defaults give it: draft when
the last 12 tokens occurred earlier; the draft is what followed the most recent such
occurrence, up to 48 tokens, and nothing when fewer than 12 followed.

With `--drift FILE` (written by scripts/lookup/record_drift.py) the times StepCost observes
also carry a recorded stretch of the machine's own drift and jitter: each replayed step's
time is multiplied by the recorded speed factor at the replay's clock (the sum of its
steps' ms so far), starting `--drift-starts` times at evenly spaced points of the record.
A plan is still costed at the quiet table, so what the drift changes is only what the
controller believed when it chose; each task's x and LU/simple are then geometric means
over the starts, with the lowest LU/simple of any start beside them.

Tasks run in scripts/bench/bench_lookup.py's order, `--rounds` times through, after its warm-up
(16 tokens of the first task), with one model acceptance record and one StepCost carried
across them as one engine carries them; the last round is printed (the plans of a
session under way, as the benchmark's repeats see them).
"""

from __future__ import annotations

import argparse, bisect, json, statistics, sys, time
from pathlib import Path

import numpy as np

from scripts.lookup.common import MODELS, WARM_TOKENS, geo_mean, no_model_files, resolve_model
from scripts.lookup.lookup_tasks import TASKS, task_engine

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17, 20, 24, 28, 33, 40, 44, 48, 49)
SIMPLE_MATCH, SIMPLE_DRAFT = 12, 48  # ngram-simple's defaults: lookup n-gram, longest draft


class CostTable:
    """Measured step time by rows, over a one-row step's, after one prompt: what each
    replayed step costs; `one_ms`, the one-row step's time there."""

    def __init__(self, ratios: dict[int, float], one_ms: float = 1.0) -> None:
        self.widths = sorted(ratios)
        self.ratios = [ratios[w] for w in self.widths]
        self.one_ms = one_ms

    def ratio(self, rows: int) -> float:
        return float(np.interp(rows, self.widths, self.ratios))


class Drift:
    """A recorded stretch of the machine's speed (scripts/lookup/record_drift.py): each recorded
    step's time over what its width costs on that record's median, by time."""

    def __init__(self, steps: list) -> None:
        by_rows: dict[int, list[float]] = {}
        for _, rows, ms in steps:
            by_rows.setdefault(rows, []).append(ms)
        one = statistics.median(by_rows[1])
        shape = {rows: statistics.median(v) / one for rows, v in by_rows.items()}
        self.at_ms = [t * 1000 for t, _, _ in steps]
        self.factors = [ms / (shape[rows] * one) for _, rows, ms in steps]
        self.span_ms = self.at_ms[-1]

    def factor(self, clock_ms: float) -> float:
        """The speed factor in force at `clock_ms` (the record repeats past its end)."""
        return self.factors[max(bisect.bisect(self.at_ms, clock_ms % self.span_ms) - 1, 0)]

    def starts(self, n: int) -> list[float]:
        return [self.span_ms * i / n for i in range(n)]


class Session:
    """What one engine carries from answer to answer for a model: the acceptance record,
    and the StepCost the controller learns from the steps it sees. `table`: the cost
    table of the task being answered; `drift`: the recorded speed the observed times carry,
    from `clock_ms` on."""

    def __init__(self, table: CostTable, drift: Drift | None = None, clock_ms: float = 0.0,
                 control: frozenset[int] = frozenset()) -> None:
        from localrun.speculation.lookup import Acceptance, StepCost

        self.table, self.acceptance, self.step_cost = table, Acceptance(), StepCost()
        self.drift, self.clock_ms = drift, clock_ms
        self.control = control  # the prompts' turn marks (Speculator.turn_marks), which no draft holds

    def step(self, rows: int, drafting: bool = True) -> float:
        cost = self.table.ratio(rows)
        ms = cost * self.table.one_ms * (self.drift.factor(self.clock_ms) if self.drift else 1.0)
        self.clock_ms += ms
        self.step_cost.observe(rows, ms, drafting)
        return cost

    def plain_answer(self, steps: int) -> None:
        """A lookup-off answer decoded on the same engine."""
        for _ in range(steps):
            self.step(1, drafting=False)


def measure(path: Path, max_tokens: int, threads: int, reps: int) -> dict:
    """Greedy answers (lookup off) to every task, and a step-cost table after each task's
    prompt, for one model."""
    from localrun.sampling import SamplingParams

    with task_engine(path, threads, TASKS) as (eng, prompts):
        answers = {}
        for name, prompt in prompts.items():
            eng.backend.kv_clear(0)
            res = eng.complete(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens, lookup=False)
            answers[name] = (list(prompt), list(res.tokens))
        control = sorted({t for prompt in prompts.values() for t in eng.speculator.turn_marks(prompt)})
        return {"answers": answers, "control": control,
                "cost": {name: measure_table(eng.backend, prompt, reps) for name, prompt in prompts.items()}}


def read_prompt(be, prompt: list[int]) -> None:
    """Sequence 0 holds `prompt` alone, read in n_batch chunks."""
    from localrun.backends.base import BatchEntry

    be.kv_clear(0)
    for pos in range(0, len(prompt), be.n_batch):
        be.decode([BatchEntry(0, prompt[pos:pos + be.n_batch], pos, 0)])


def timed_step(be, prompt: list[int], rows: int) -> float:
    """Seconds of one step of `rows` rows (every row's logits) after `prompt`, which
    sequence 0 holds again afterwards."""
    from localrun.backends.base import BatchEntry

    filler = (prompt * (rows // len(prompt) + 1))[:rows]  # which tokens does not change a step's time
    t0 = time.perf_counter()
    be.decode([BatchEntry(0, filler, len(prompt), rows)])
    elapsed = time.perf_counter() - t0
    be.kv_trim(0, len(prompt))
    return elapsed


def measure_table(be, prompt: list[int], reps: int) -> dict:
    """Step times after `prompt`, every width in turn, `reps` rounds (medians): the ratios
    to a one-row step's, and that step's ms."""
    read_prompt(be, prompt)
    times: dict[int, list[float]] = {w: [] for w in WIDTHS}
    for _ in range(reps):
        for w in WIDTHS:
            times[w].append(timed_step(be, prompt, w))
    one = statistics.median(times[1])
    return {"one_ms": one * 1000, "ratios": {w: statistics.median(t) / one for w, t in times.items()}}


def cost_tables(cost: dict) -> dict[str, CostTable]:
    """Task -> its table, from measure()'s or a loaded file's "cost" (JSON keys are
    strings). A file written before tables were measured per task holds one table (width
    -> ratio), used for every task."""
    if all(isinstance(v, dict) for v in cost.values()):
        return {name: CostTable({int(w): r for w, r in t["ratios"].items()}, t["one_ms"]) for name, t in cost.items()}
    one = CostTable({int(w): r for w, r in cost.items()})
    return {name: one for name in TASKS}


def ngram_simple(history: list[int], room: int) -> list[int]:
    """llama-server's ngram-simple draft for a history whose last token is the pending one."""
    n, seen = SIMPLE_MATCH, len(history) - 1  # tokens before the pending one
    if seen <= n + SIMPLE_DRAFT + 1:
        return []
    tail = history[-n:]
    for start in range(seen - n - 1, 0, -1):
        if history[start:start + n] == tail:
            take = min(SIMPLE_DRAFT, seen - (start + n), room)
            return history[start + n:start + n + take] if take >= n else []
    return []


def replay(rule: str, prompt: list[int], answer: list[int], session: Session, max_tokens: int):
    """(cost in one-row steps, steps, accepted, drafted) of answering with `rule`. The
    first token comes from the prompt's step, as in the engine; each decode step then
    feeds the pending token and a draft, and yields the draft's agreeing prefix plus one."""
    from localrun.backends.base import common_prefix
    from localrun.speculation.lookup import LookupProposer, LookupConfig

    ctrl = (LookupProposer(LookupConfig(), session.step_cost, session.acceptance, answer_start=len(prompt),
                            control=session.control)
            if rule == "localrun" else None)
    truth = answer + [-1]  # nothing drafts past the answer's end
    pos, spent, steps, accepted, drafted = 1, 0.0, 0, 0, 0
    while pos < len(answer):
        history, room = prompt + answer[:pos], max_tokens - pos - 1
        draft = [] if room <= 0 else ngram_simple(history, room) if ctrl is None else ctrl.draft(history, room)
        kept = common_prefix(draft, truth[pos:])
        if ctrl is not None and draft:
            ctrl.record(len(draft), kept)
        # ngram-simple's steps are llama-server's: the engine's StepCost never sees them
        spent += session.step(len(draft) + 1) if ctrl is not None else session.table.ratio(len(draft) + 1)
        steps, accepted, drafted, pos = steps + 1, accepted + kept, drafted + len(draft), pos + kept + 1
    return spent, steps, accepted, drafted


def session_plans(data: dict, tables: dict[str, CostTable], rounds: int, plain_between: int, max_tokens: int,
                  drift: Drift | None = None, start_ms: float = 0.0) -> dict:
    """Task -> rule -> replay()'s plan, of the last of `rounds` times through the tasks on
    one session (bench_lookup.py's warm-up first, a lookup-off answer after each task)."""
    first = next(iter(TASKS))
    # a file written before turn marks were recorded replays drafts through them
    session, rows = Session(tables[first], drift, start_ms, frozenset(data.get("control", ()))), {}
    first_prompt, first_answer = data["answers"][first]
    session.plain_answer(WARM_TOKENS)  # bench_lookup.py's warm-up: plain, then with lookup
    replay("localrun", first_prompt, first_answer[:WARM_TOKENS], session, WARM_TOKENS)
    for _ in range(rounds):
        for name in TASKS:
            prompt, answer = data["answers"][name]
            session.table = tables[name]
            rows[name] = {rule: replay(rule, prompt, answer, session, max_tokens) for rule in ("localrun", "simple")}
            session.plain_answer(plain_between)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), help=f"short names {list(MODELS)} or paths")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="threads of the measured steps (default 1)")
    ap.add_argument("--cost-reps", type=int, default=7, help="timed rounds over the widths (medians)")
    ap.add_argument("--rounds", type=int, default=2, help="times through the tasks; the last is printed")
    ap.add_argument("--plain-between", type=int, default=None,
                    help="one-row steps of a lookup-off answer after each lookup answer (default: --max-tokens, "
                    "as bench_lookup.py's plain run on the same engine; 0: a session with lookup always on)")
    ap.add_argument("--out", help="write answers, cost tables and plans as JSON")
    ap.add_argument("--load", help="replay the answers and cost tables of an earlier --out instead of "
                    "measuring (two versions of the controller judged on the same table)")
    ap.add_argument("--drift", help="a recorded drift (scripts/lookup/record_drift.py) the observed step times carry")
    ap.add_argument("--drift-starts", type=int, default=6, help="replays per model, from evenly spaced points "
                    "of the drift record (default 6)")
    args = ap.parse_args(argv)
    plain_between = args.max_tokens if args.plain_between is None else args.plain_between
    if args.load and not Path(args.load).is_file():
        print(f"error: no file {args.load}: give a file that an earlier run wrote with --out", file=sys.stderr)
        return 2
    if args.drift and not Path(args.drift).is_file():
        print(f"error: no file {args.drift}: record one with python -m scripts.lookup.record_drift --out FILE",
              file=sys.stderr)
        return 2
    if args.drift_starts < 1:
        print("error: --drift-starts must be 1 or more", file=sys.stderr)
        return 2
    try:
        drift = Drift(json.loads(Path(args.drift).read_text())["steps"]) if args.drift else None
    except (ValueError, KeyError, TypeError, IndexError):
        print(f"error: {args.drift} is not a drift record with one-row steps: record one with "
              "python -m scripts.lookup.record_drift --out FILE", file=sys.stderr)
        return 2
    loaded = json.loads(Path(args.load).read_text()) if args.load else {}
    resolved = [resolve_model(m) for m in (list(loaded) or args.models)]
    if no_model_files(p for label, p in resolved if label not in loaded):
        return 2
    report = {}
    print(f"x = lookup off's steps / the plan's cost in one-row steps; a/d = accepted/drafted; "
          f"{args.max_tokens} tokens, round {args.rounds} of {args.rounds}"
          + (f"; under {args.drift}'s drift from {args.drift_starts} starts (geometric means, a/d summed)"
             if drift else ""))
    for label, path in resolved:
        data = loaded[label] if label in loaded else measure(path, args.max_tokens, args.threads, args.cost_reps)
        tables = cost_tables(data["cost"])
        print(f"\n{label}: step cost by rows, after each task's prompt (one-row step's ms first)")
        shown = tables.items() if len({id(t) for t in tables.values()}) > 1 else [("(all)", tables[next(iter(TASKS))])]
        for name, t in shown:
            print(f"  {name:<9}{t.one_ms:5.1f} ms  " + " ".join(f"{w}:{r:.1f}" for w, r in zip(t.widths, t.ratios)))
        print(f"  {'task':<9}{'localrun x':>11}{'a/d':>10}{'simple x':>10}{'a/d':>10}{'LU/simple':>11}"
              + (f"{'lowest':>9}" if drift else ""))
        runs = [session_plans(data, tables, args.rounds, plain_between, args.max_tokens, drift, start)
                 for start in (drift.starts(args.drift_starts) if drift else [0.0])]
        rows = runs[-1]
        ratios: dict[str, list[tuple[float, float]]] = {}
        for name, r in rows.items():
            plain = len(data["answers"][name][1]) - 1
            simple = plain / r["simple"][0]  # ngram-simple's plan does not depend on prices
            lus = [plain / run[name]["localrun"][0] for run in runs]
            lu = geo_mean(lus)
            ratios.setdefault(TASKS[name][0], []).append((lu, lu / simple))
            accepted, drafted = (sum(run[name]["localrun"][i] for run in runs) for i in (2, 3))
            lowest = f"{min(lus) / simple:>9.2f}" if drift else ""
            print(f"  {name:<9}{lu:>10.2f}x{accepted:>5}/{drafted:<4}{simple:>9.2f}x"
                  f"{r['simple'][2]:>5}/{r['simple'][3]:<4}{lu / simple:>11.2f}{lowest}")
        for group, pairs in ratios.items():
            x, vs = [p[0] for p in pairs], [p[1] for p in pairs]
            print(f"  {group}: localrun x {geo_mean(x):.2f} (lowest {min(x):.2f}), "
                  f"LU/simple {geo_mean(vs):.2f} (lowest {min(vs):.2f}), geometric means")
        report[label] = {"answers": data["answers"], "control": data.get("control", []), "cost": data["cost"],
                         "plans": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

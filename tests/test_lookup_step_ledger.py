"""scripts/lookup/lookup_step_ledger.py: the step alignment on steps written here (where the
answer is known), and the script run as a user runs it on the real SmolLM2."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.lookup.lookup_step_ledger import Step, _mean_se, estimate, ledger

pytestmark = pytest.mark.research
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "scripts.lookup.lookup_step_ledger"

FIRST = 50  # the position after the first token: decode steps start here


def _clocked(steps: list[tuple[int, int, float]], between: float = 0.0) -> list[Step]:
    """(pos, rows, ms) back to back, `between` ms apart: each Step with its end on the clock."""
    out, now = [], 0.0
    for pos, rows, ms in steps:
        now += ms
        out.append(Step(pos, rows, ms, now))
        now += between
    return out


def _off(n: int, ms: float = 10.0, between: float = 0.0) -> list[Step]:
    """Lookup off: the first token's step (it fed the prompt's last token), then one row a position."""
    return _clocked([(FIRST - 1, 1, 99.0)] + [(FIRST + i, 1, ms) for i in range(n)], between)


def test_a_kept_draft_is_set_against_the_off_steps_over_the_positions_it_advanced():
    # on: plain, a 4-row step keeping 3 of its draft (advances 4), two plain steps after it, plain
    on = _clocked([(FIRST - 1, 1, 99.0), (50, 1, 10.0), (51, 4, 25.0), (55, 1, 12.0), (56, 1, 11.0), (57, 1, 10.0)],
                  between=0.5)  # lookup's work between decodes: 0.5 ms a step, against lookup off's 0.25
    book = ledger(on, _off(8, between=0.25), FIRST, after=2)
    assert book.on["wide"] == 25.0 and book.off["wide"] == 40.0  # positions 51-54 cost lookup off 4 steps
    assert book.delta("after") == 12.0 + 11.0 - 20.0
    assert book.on["plain"] == book.off["plain"] == 20.0  # position 50, and 57 with the end
    assert book.wide == [(51, 4, 4, 25.0, 40.0)]
    assert book.t_off == pytest.approx(8 * 10.0 + 8 * 0.25)  # from the first token to the last
    assert book.outside == pytest.approx(5 * 0.5 - 8 * 0.25)
    assert book.cost == pytest.approx(-15.0 + 3.0 + 0.5)


def test_a_rejected_draft_advances_one_position_and_is_paid_in_full():
    on = _clocked([(FIRST - 1, 1, 99.0), (50, 6, 30.0), (51, 1, 10.0), (52, 1, 10.0)])
    book = ledger(on, _off(3), FIRST, after=0)
    assert (book.on["wide"], book.off["wide"]) == (30.0, 10.0)
    assert book.delta("after") == 0.0 and book.on["plain"] == 20.0  # --after 0: nothing counted after it
    assert book.cost == 20.0


def test_positions_the_first_tokens_draft_advanced_are_savings_of_the_wide_kind():
    # the first token's step carried a draft: lookup on starts decoding at 53, lookup off at 50
    on = _clocked([(FIRST - 1, 4, 40.0), (53, 1, 10.0), (54, 1, 10.0)])
    book = ledger(on, _off(5), FIRST, after=1)
    assert (book.on["wide"], book.off["wide"]) == (0.0, 30.0)
    assert (book.on["after"], book.off["after"]) == (10.0, 10.0)  # the step right after it is its own
    assert book.on["plain"] == book.off["plain"] == 10.0


def test_where_the_texts_part_the_pair_ends_before_the_lookup_step_that_made_the_difference():
    # lookup off's token 5 differs: off's step at 50 + 5 - 1 = 54 produced it; lookup's
    # 3-row step at 53 advanced past it (to 56), so the pair is counted up to position 53
    on = _clocked([(FIRST - 1, 1, 99.0), (50, 1, 10.0), (51, 2, 15.0), (53, 3, 20.0), (56, 1, 10.0)])
    book = ledger(on, _off(8), FIRST, after=0, differ=5)
    assert book.wide == [(51, 2, 2, 15.0, 20.0)]
    assert book.on["plain"] == book.off["plain"] == 10.0
    assert book.t_off == pytest.approx(30.0)  # positions 50-52
    assert ledger(on, _off(8), FIRST, after=0, differ=1) is None  # parted at once: nothing to compare


def test_the_estimate_is_the_off_time_over_the_off_time_plus_the_mean_cost_with_its_interval():
    mid, low, high = estimate([10.0, 30.0, 20.0], [1000.0, 1000.0, 1000.0])
    assert mid == pytest.approx(1000 / 1020)
    assert low < mid < high
    assert estimate([10.0], [1000.0]) is None
    assert estimate([-900.0, -100.0], [1000.0, 1000.0])[2] == math.inf  # the interval reaches past saving it all


def test_the_table_prints_a_kept_draft_as_a_saving_and_a_rejected_one_as_a_cost():
    """The sign of the table's wide and D columns, on steps whose costs are known (not on this
    machine's clock): a 4-row step that keeps its draft costs less than the 4 one-row steps
    of lookup off it replaces; one whose draft is rejected advances one position and costs
    more than the one step it replaces."""
    def pairs(advanced: int) -> list:
        return [ledger(_clocked([(FIRST - 1, 1, 99.0), (50, 4, 14.0 + j), (50 + advanced, 1, 10.0),
                                 (51 + advanced, 1, 10.0)]), _off(6), FIRST, after=1) for j in range(3)]

    def column(values: list[float]) -> float:  # as the table prints it: "mean ±se"
        return float(_mean_se(values).split("±")[0])

    kept, rejected = pairs(4), pairs(1)
    assert [b.delta("wide") for b in kept] == [14.0 - 40.0, 15.0 - 40.0, 16.0 - 40.0]
    assert [b.delta("wide") for b in rejected] == [14.0 - 10.0, 15.0 - 10.0, 16.0 - 10.0]
    assert column([b.delta("wide") for b in kept]) == column([b.cost for b in kept]) == -25.0
    assert column([b.delta("wide") for b in rejected]) == column([b.cost for b in rejected]) == +5.0
    assert estimate([b.cost for b in kept], [b.t_off for b in kept])[0] > 1  # faster with lookup on
    assert estimate([b.cost for b in rejected], [b.t_off for b in rejected])[0] < 1


def test_the_script_prints_each_task_with_its_cost_and_ratio(smollm2_gguf):
    done = subprocess.run([sys.executable, "-m", SCRIPT, "--model", str(smollm2_gguf),
                           "--tasks", "edit", "bicycle", "--pairs", "2", "--max-tokens", "24", "--steps"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {m.group(1): m for m in re.finditer(
        r"^(edit|bicycle) +(\d)/2 +\d +(\d+) +([+-][\d.]+) ±.*?(\d\.\d{3}) \((\d\.\d{3})-(\d\.\d{3}|inf)\)", done.stdout, re.M)}
    assert set(rows) == {"edit", "bicycle"}, done.stdout
    edit = rows["edit"]
    assert edit.group(2) == "2"  # both pairs counted (a pair whose texts part is cut, not dropped)
    # (the sign of the wide column on known steps: the test above; here it is this machine's timing)
    assert float(edit.group(6)) <= float(edit.group(5)) <= float(edit.group(7))  # "inf" reads as infinity
    assert re.search(r"pos +\d+ rows +\d+ advanced +\d+: +[\d.]+ ms, off +[\d.]+ ms", done.stderr)


def test_an_unknown_task_is_one_error_line():
    done = subprocess.run([sys.executable, "-m", SCRIPT, "--tasks", "sonnet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("error: unknown task(s) ['sonnet']") and done.stderr.count("\n") == 1

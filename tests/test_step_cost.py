"""StepCost (localrun/speculation/step_cost.py): what a speculative step of r rows costs on this
model, learned from the steps the engine times, as LookupProposer reads it."""

from __future__ import annotations

import numpy as np
import pytest

from localrun.speculation.lookup import LookupProposer, LookupConfig, StepCost


def _learned(cost: StepCost, rows: int, ratio: float, rounds: int = 40, one_row_ms: float = 10.0) -> StepCost:
    for _ in range(rounds):
        cost.observe(1, one_row_ms)
        cost.observe(rows, ratio * one_row_ms)
    return cost


def test_step_cost_starts_from_the_prior_and_learns_a_measured_width():
    cost = StepCost()
    assert cost.one_row_ms() is None
    assert cost.ratio(5, 0.25) >= 1.0 and cost.ratio(5, 0.25) <= 2.0  # nothing measured: the prior line (1 + 4 * 0.25), optimistic
    unmeasured_20 = cost.ratio(20, 0.25)
    _learned(cost, 17, 6.8)  # sublinear, as llama.cpp on a CPU: weights read once a step
    assert cost.one_row_ms() == pytest.approx(10.0, rel=0.03)
    assert cost.ratio(17, 0.25) == pytest.approx(6.8, rel=0.1)
    # a neighbour shares what was learned: 20 rows are dearer than the prior said
    assert cost.ratio(20, 0.25) > 1.3 * unmeasured_20
    top = StepCost.MAX_ROWS
    assert cost.ratio(top + 4, 0.25) == pytest.approx(cost.ratio(top, 0.25) + 4 * 0.25)  # past the widest: extended


def test_step_cost_tells_the_machine_slowing_down_from_a_dear_width():
    cost = _learned(StepCost(), 17, 6.8)
    for i in range(40):  # the machine slows to half speed while only wide steps run
        cost.observe(17, 68.0 * (1 + i / 39))
    for _ in range(10):
        cost.observe(1, 20.0)  # one-row steps show the slowing for what it is
    assert cost.one_row_ms() == pytest.approx(20.0, rel=0.1)
    # a ratio to the one-row steps before the slowing (localrun's earlier rule) said 13.6
    assert cost.ratio(17, 0.25) == pytest.approx(6.8, rel=0.15)


def test_a_step_slowed_by_load_does_not_make_its_width_look_dear():
    cost = StepCost()
    for ms in (10.0,) * 20 + (45.0,):  # the last one-row step lost the core for a while
        cost.observe(1, ms)
    assert cost.one_row_ms() < 13.0
    _learned(cost, 4, 2.0, rounds=20)
    before, drafted = cost.ratio(4, 0.5), LookupProposer(LookupConfig(), cost).best_length(0.9, 3)
    assert drafted >= 2
    cost.observe(4, 70.0)  # a 4-row step that lost the core
    cost.observe(1, 10.0)
    assert cost.ratio(4, 0.5) < 1.1 * before
    assert LookupProposer(LookupConfig(), cost).best_length(0.9, 3) == drafted  # priced as before


def test_a_width_judged_dear_is_measured_afresh_later():
    cost = StepCost()
    for _ in range(5):
        cost.observe(1, 10.0)
    cost.observe(4, 80.0)  # its only measurement, slowed: no draft of 3 pays at that price
    assert LookupProposer(LookupConfig(), cost).best_length(0.9, 3) < 3
    for _ in range(2 * StepCost.STALE_STEPS):
        cost.observe(1, 10.0)  # a drafting answer's one-row steps: the width's estimate fades
    assert LookupProposer(LookupConfig(), cost).best_length(0.9, 3) == 3  # tried again


def test_only_steps_that_could_draft_age_a_width():
    cost = StepCost()
    for _ in range(5):
        cost.observe(1, 10.0)
    cost.observe(4, 80.0)
    dear = cost.ratio(4, 0.25)
    for _ in range(2 * StepCost.STALE_STEPS):
        cost.observe(1, 10.0, drafting=False)  # a lookup-off answer
    assert cost.ratio(4, 0.25) == pytest.approx(dear, rel=0.02)  # nothing could have measured it again
    for _ in range(20):
        cost.observe(1, 20.0, drafting=False)  # ...on a machine that got loaded
    assert cost.one_row_ms() == pytest.approx(20.0, rel=0.05)  # its speed is followed


def test_step_cost_follows_a_long_drifting_session_without_losing_its_footing():
    rng = np.random.default_rng(1)
    cost, speed = StepCost(), 10.0
    for _ in range(20000):  # a random walk of the speed, jitter, and a step in a hundred slowed 5x
        speed = min(max(speed * float(np.exp(rng.normal(0, 0.01))), 3.0), 40.0)
        rows = int(rng.choice([1, 1, 1, 2, 5, 12, 20, 33, 49]))
        slowed = 5.0 if rng.random() < 0.01 else 1.0
        cost.observe(rows, speed * (1 + 0.4 * (rows - 1)) * float(np.exp(rng.normal(0, 0.08))) * slowed,
                     drafting=bool(rng.random() < 0.8))
    assert cost.one_row_ms() == pytest.approx(speed, rel=0.15)
    for rows in (2, 5, 12, 20, 33, 49):  # each width near its true cost (a little under: the optimism)
        assert 0.8 * (1 + 0.4 * (rows - 1)) <= cost.ratio(rows, 0.25) <= 1.05 * (1 + 0.4 * (rows - 1))


class _DenseStepCost(StepCost):
    """The filter with every one-row step applied to the whole state at once (the
    reference the held one-row steps must agree with)."""

    def _one_row(self, ms: float) -> None:
        self._update(0, ms)


def test_one_row_steps_queued_and_held_out_of_the_shape_update_it_as_the_whole_filter_would():
    rng = np.random.default_rng(7)
    held, dense = StepCost(), _DenseStepCost()
    assert held.FOLD_AT_MOST < 2000  # the run below folds the held steps in at their limit too
    speed = 10.0
    for i in range(4000):  # long one-row runs (a lookup-off answer), wide steps, fades, load spikes
        speed = min(max(speed * float(np.exp(rng.normal(0, 0.01))), 3.0), 40.0)
        rows = 1 if (i // 500) % 2 or rng.random() < 0.7 else int(rng.choice([2, 5, 17, 33]))
        ms = speed * (1 + 0.4 * (rows - 1)) * float(np.exp(rng.normal(0, 0.08))) * (5.0 if rng.random() < 0.01 else 1.0)
        drafting = (i // 1300) % 2 == 0
        held.observe(rows, ms, drafting)
        dense.observe(rows, ms, drafting)
        if i % 97 == 0:  # a price read while one-row steps are held
            assert held.ratio(17, 0.25) == pytest.approx(dense.ratio(17, 0.25), rel=1e-9)
    assert held._queued  # the last one-row steps are queued, not yet taken
    assert held.one_row_ms() == pytest.approx(dense.one_row_ms(), rel=1e-12)
    assert held._folding > 0 and not held._queued  # taken, and held out of the shape's update
    for rows in range(2, StepCost.MAX_ROWS + 1):
        assert held.ratio(rows, 0.25) == pytest.approx(dense.ratio(rows, 0.25), rel=1e-9)
    held._settle()
    np.testing.assert_allclose(held._cov, dense._cov, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(held._mean, dense._mean, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("measure_cost", [True, False])
def test_every_widths_price_at_once_is_each_widths_price(measure_cost):
    """best_length reads one list of prices: it must hold each width's price, the filter's
    optimistic shape up to the widths it knows and the config's line a row past them (or
    the config's line alone when costs are not measured)."""
    cost = StepCost()
    rng = np.random.default_rng(5)
    for step in range(300):
        rows = 1 if step % 7 else int(rng.integers(2, 30))
        cost.observe(rows, 20.0 * (1 + 0.6 * (rows - 1)) * float(np.exp(rng.normal(0, 0.08))))
    per = LookupConfig().cost_per_draft
    ctrl = LookupProposer(LookupConfig(measure_cost=measure_cost), cost)
    most, known = StepCost.MAX_ROWS + 9, StepCost.MAX_ROWS
    prices = ctrl.row_costs(most)
    if measure_cost:
        cost._take_queued()
        shape = cost._shape_prices()
        want = shape + [shape[known] + per * (r - known) for r in range(known + 1, most + 1)]
        assert want[20] > 1.0 + per * 19  # learned from the steps above, not the prior line
    else:
        want = [1.0] + [1.0 + per * (r - 1) for r in range(1, most + 1)]
    assert prices == pytest.approx(want, rel=1e-12) and prices[:2] == [1.0, 1.0]
    assert [ctrl.row_cost(r) for r in range(1, most + 1)] == prices[1:]
    assert ctrl.row_costs(5) == prices[:6]

"""scripts/bench/bench_draft.py's pure parts: its arguments, the table's medians and paired
ratios, and the printout of predicted speedups (the benchmark itself loads two models and
two llama-servers for minutes and is not run here)."""

from __future__ import annotations

import pytest

from localrun.speculation.draft_model import predicted_speedup
from scripts.bench.bench_draft import (ENGINES, configs, format_costs, format_table, gpu_costs, parse_args,
                                       summarize)


def test_quick_means_one_greedy_repeat_of_64_tokens_unless_told_otherwise():
    a = parse_args(["--quick"])
    assert (a.repeat, a.max_tokens, a.sampled) == (1, 64, False)
    assert [c[2] for c in configs(a)] == [0.0, 0.0]
    a = parse_args(["--quick", "--sampled", "--repeat", "2"])
    assert (a.repeat, a.max_tokens, a.sampled) == (2, 64, True)
    a = parse_args([])
    assert (a.repeat, a.max_tokens, a.sampled, a.engines) == (3, 160, True, ENGINES)
    # the sampled configuration is the first task again, at temperature 0.7
    assert configs(a) == [("edit", "edit", 0.0), ("bicycle", "bicycle", 0.0), ("edit@t0.7", "edit", 0.7)]
    assert parse_args(["--no-sampled"]).sampled is False


def _run(tps, drafted=0, accepted=0, widths=(), tokens=(1, 2, 3), **extra):
    return {"tokens": list(tokens), "decode_tps": tps, "drafted": drafted, "accepted": accepted,
            "widths": list(widths), **extra}


def test_rows_carry_medians_paired_ratios_and_the_draft_models_offers():
    runs = {"edit": {
        "lr_plain": [_run(10.0), _run(12.0), _run(11.0)],
        "lr_draft": [_run(15.0, 20, 15, [4, 4, 0], model_asked=30, model_judged=20, model_accepted=15),
                     _run(18.0, 10, 9, [4], model_asked=30, model_judged=10, model_accepted=9),
                     _run(11.0, 6, 3, [2, 0], tokens=(1, 9), model_asked=30, model_judged=6, model_accepted=3)],
        "ls_plain": [_run(12.0), _run(12.0), _run(12.0)], "ls_draft": [_run(6.0), _run(6.0), _run(6.0)]}}
    (row,) = summarize(runs)
    assert row["decode_tps"] == {"lr_plain": 11.0, "lr_draft": 15.0, "ls_plain": 12.0, "ls_draft": 6.0}
    mean, low, high = row["ratios"]["lrD/lr"]  # repeat by repeat: 1.5, 1.5, 1.0
    assert mean == pytest.approx((1.5 * 1.5 * 1.0) ** (1 / 3)) and low < mean < high
    assert row["ratios"]["lsD/ls"] == (pytest.approx(0.5),) * 3
    assert row["ratios"]["lrD/lsD"][0] == pytest.approx((15 / 6 * 18 / 6 * 11 / 6) ** (1 / 3))
    assert "lrLD/lr" not in row["ratios"]  # lookup + draft did not run
    d = row["drafts"]["lr_draft"]
    assert (d["drafted"], d["accepted"], d["model_judged"], d["runs"]) == (36, 27, 36, 3)
    assert d["widths"] == {0: 2, 2: 1, 4: 3}
    assert row["differ"] == []  # only the first repeat's text is compared, and it matches
    table = format_table([row], 3)
    assert "median of 3" in table and "1.31 (" in table
    assert "lr_draft         9/12 (acceptance 0.75)  model 9/12, asked 30  widths {0: 2, 2: 1, 4: 3}" in table


def test_one_repeat_gives_the_one_ratio_and_a_failed_run_none():
    runs = {"poem": {"lr_plain": [_run(10.0)], "lr_draft": [_run(8.0, tokens=(7,))],
                     "lr_lookup": [_run(None)]}}
    (row,) = summarize(runs)
    assert row["ratios"]["lrD/lr"] == (pytest.approx(0.8),) * 3
    assert row["ratios"]["lrL/lr"] is None
    assert row["decode_tps"]["lr_lookup"] is None
    assert row["differ"] == ["lr_draft"]  # lookup's run failed, but its text is lr_plain's
    table = format_table([row], 1)
    assert "0.80" in table and "text differs from lr_plain's in lr_draft" in table


def test_gpu_costs_grow_by_a_fiftieth_of_a_step_a_row():
    c = gpu_costs(16)
    assert len(c) == 18 and c[1] == 1.0 and c[2] == pytest.approx(1.02) and c[17] == pytest.approx(1.32)


def test_the_printout_has_the_measured_costs_and_both_regimes_predictions():
    costs = [1.0, 1.0, 1.9, 2.6, 3.3, 4.0, 4.6, 5.2, 5.8, 6.4]  # a 2-core CPU's: a row costs most of a step
    text = format_costs(52.0, 101.0, 0.515, costs, 8)
    assert "draft step 52.0 ms, target one-row step 101.0 ms, delta 0.515; c(2) 1.90, c(4) 3.30, c(8) 5.80" in text
    here, gpu = text.splitlines()[1:]
    assert "odds 0.9: k=0 x1.00" in here  # nothing pays when a row costs 0.9 of a step and a draft half one
    k, s = predicted_speedup(0.8, gpu_costs(8), 0.1, 8)
    assert k > 0 and s > 1.5 and f"odds 0.8: k={k} x{s:.2f}" in gpu
    # before any draft step was timed the prices are priors: the times print as "-"
    assert "draft step -, target one-row step -, delta 0.500" in format_costs(None, None, 0.5, costs, 8)

"""scripts/bench/bench_lookup.py's statistics: the paired ratio of two engines' speeds and the
table rows it goes into (the benchmark itself runs for minutes and is not run here)."""

from __future__ import annotations

import math

import pytest

from scripts.bench.bench_lookup import paired_ratio, task_rows


def test_paired_ratio_is_the_geometric_mean_of_each_repeats_ratio_with_a_t_interval():
    mean, low, high = paired_ratio([110.0, 100.0], [100.0, 110.0])  # 1.1x, then 1/1.1x
    assert mean == pytest.approx(1.0)
    # two pairs: one degree of freedom, t = 12.71; the logs' sd is ln(1.1) * sqrt(2)
    half = 12.71 * math.log(1.1) * math.sqrt(2) / math.sqrt(2)
    assert (low, high) == (pytest.approx(math.exp(-half)), pytest.approx(math.exp(half)))
    steady = paired_ratio([50.0, 60.0, 70.0], [25.0, 30.0, 35.0])
    assert steady == (pytest.approx(2.0), pytest.approx(2.0), pytest.approx(2.0))


def test_paired_ratio_pairs_runs_by_repeat_and_skips_a_failed_run():
    # the medians' ratio would say 1.0 (median 60 over median 60); run by run it is 1.2
    assert paired_ratio([60.0, 72.0, 48.0], [50.0, 60.0, 40.0])[0] == pytest.approx(1.2)
    assert paired_ratio([60.0, None, 48.0], [50.0, 60.0, 40.0])[0] == pytest.approx(1.2)
    assert paired_ratio([60.0], [50.0]) is None  # one pair has no spread to judge


def _one_task(task, prompt_tokens, tps_by_engine):
    """bench_lookup's per-model work record for one task whose engines ran at these speeds
    (each run 32 tokens, 10 of 12 drafted ones kept: task_rows reads only the speeds here)."""
    run = {"accepted": 10, "drafted": 12, "tokens": [1] * 32, "generated": 32, "steps": 20}
    return {"runs": {task: {e: [{**run, "decode_tps": t} for t in tps] for e, tps in tps_by_engine.items()}},
            "prompt_tokens": {task: prompt_tokens}, "stable_across_repeats": {task: True}, "diffs": {},
            "text_lookup": {}}


def test_task_rows_carry_the_paired_ratio_of_every_engine_pair_that_ran():
    w = _one_task("bicycle", 36, {"lr_lookup": [60.0, 66.0, 57.0], "lr_plain": [62.0, 60.0, 60.0]})
    (row,) = task_rows("smollm2", w, ["bicycle"])
    mean, low, high = row["paired"]["LU/off"]
    assert mean == pytest.approx((60 / 62 * 66 / 60 * 57 / 60) ** (1 / 3))
    assert low < mean < high
    assert "LU/simple" not in row["paired"]  # llama-server did not run


def test_task_rows_set_localruns_plain_decode_against_llama_servers():
    w = _one_task("quote", 270, {"lr_plain": [24.0, 25.0, 27.0], "ls_plain": [27.0, 25.0, 30.0]})
    (row,) = task_rows("qwen", w, ["quote"])
    assert row["ratios"]["off/none"] == pytest.approx(25.0 / 27.0)  # medians
    assert row["paired"]["off/none"][0] == pytest.approx((24 / 27 * 25 / 25 * 27 / 30) ** (1 / 3))
    assert row["ratios"]["LU/off"] is None and "LU/off" not in row["paired"]  # lookup did not run

"""scripts/bench/draft_steps.py's arithmetic: the two arms' tokens per second, their ratio
and its interval (the benchmark itself loads the 1.5B pair and runs for minutes)."""

from __future__ import annotations

import pytest

from scripts.bench.draft_steps import arm_ratio, parse_args


def test_the_ratio_is_tokens_per_second_of_the_asked_steps_over_the_skipped():
    asked = [(0.030, 1), (0.031, 1), (0.029, 1), (0.030, 3)]  # one kept draft: 3 tokens in a step
    skipped = [(0.030, 1), (0.030, 1), (0.030, 1), (0.030, 1)]
    r = arm_ratio(asked, skipped)
    assert r["asked_tps"] == pytest.approx(6 / 0.120) and r["skipped_tps"] == pytest.approx(4 / 0.120)
    assert r["ratio"] == pytest.approx(1.5) and r["steps"] == (4, 4)
    lo, hi = r["interval"]
    assert lo < 1.5 < hi


def test_a_costly_ask_reads_under_one_and_its_interval_narrows_with_steps():
    few = arm_ratio([(0.031, 1), (0.032, 1)] * 5, [(0.030, 1), (0.031, 1)] * 5)
    many = arm_ratio([(0.031, 1), (0.032, 1)] * 500, [(0.030, 1), (0.031, 1)] * 500)
    assert few["ratio"] == pytest.approx(many["ratio"]) == pytest.approx(0.061 / 0.063)
    assert many["interval"][1] < 1.0  # a 3% cost, told apart from none
    assert many["interval"][1] - many["interval"][0] < few["interval"][1] - few["interval"][0]


def test_one_step_an_arm_has_no_interval():
    assert "interval" not in arm_ratio([(0.03, 1)], [(0.03, 1)])
    assert parse_args(["--tasks", "bicycle", "--answers", "2"]).answers == 2


def test_the_proposer_picks_the_default_model():
    assert parse_args([]).target.endswith("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    assert parse_args(["--proposer", "lookup"]).target.endswith("smollm2-135m-instruct-q4_1.gguf")
    assert parse_args(["--proposer", "lookup", "--target", "m.gguf"]).target == "m.gguf"

"""scripts/bench/bench_depth.py's pure parts: its arguments, llama-bench's JSON, the medians,
the ratio against the faster native setting and the table (the benchmark itself runs
llama-bench and localrun for minutes and is not run here)."""

from __future__ import annotations

import pytest

from localrun.hardware import inference_threads
from scripts.bench.bench import SMOLLM2
from scripts.bench.bench_depth import GOAL, QWEN, best, fa_label, format_table, parse_args, parse_native, summarize

# `llama-bench -p 0 -n 8 -d 64 -t 2 -fa 0 -r 1 -o json` on SmolLM2 (fields trimmed)
NATIVE_JSON = """[
  {
    "build_commit": "unknown",
    "model_type": "llama 256M Q4_1",
    "n_threads": 2,
    "flash_attn": 0,
    "n_prompt": 0,
    "n_gen": 8,
    "n_depth": 64,
    "avg_ns": 1012374467,
    "stddev_ns": 0,
    "avg_ts": 7.902214,
    "stddev_ts": 0.000000,
    "samples_ns": [ 1012374467 ],
    "samples_ts": [ 7.90221 ]
  }
]"""


def test_defaults_are_the_issues_setting_and_quick_is_one_small_round():
    a = parse_args([])
    assert (a.depth, a.n_gen, a.repeat, a.best_of) == (832, 128, 3, 3)
    assert a.models[0] == SMOLLM2 and a.models[-1] == QWEN and len(a.models) == 3
    assert a.threads == sorted({1, inference_threads()})
    a = parse_args(["--quick"])
    assert (a.models, a.repeat, a.n_gen, a.depth, a.threads) == ([SMOLLM2], 1, 32, 256, [inference_threads()])
    assert a.best_of == 1
    assert parse_args(["--quick", "--threads", "1"]).threads == [1]
    for bad in (["--best-of", "0"], ["--repeat", "0"], ["--quick", "--best-of", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_native_speeds_are_the_tg_tests_samples_and_a_process_counts_its_fastest():
    assert parse_native(NATIVE_JSON) == [pytest.approx(7.90221)]
    # with a pp test in the list too, the tg one is still the one read; each repetition is a sample
    two = '[{"n_gen": 0, "avg_ts": 500.0, "samples_ts": [500.0]}, {"n_gen": 128, "avg_ts": 90.5, "samples_ts": [88.0, 93.0]}]'
    assert parse_native(two) == [88.0, 93.0]
    assert parse_native('[{"n_gen": 128, "avg_ts": 90.5}]') == [90.5]  # an older build without samples
    # load only slows a run: the fastest of a process's runs is the one it touched least
    assert best([88.0, 93.0, 71.5]) == {"decode_tps": 93.0, "samples": [88.0, 93.0, 71.5]}


def test_ratio_is_localrun_over_the_faster_native_setting():
    row = summarize({"native_fa_off": [80.0, 90.0, 85.0], "native_fa_on": [100.0, 96.0, 98.0],
                     "localrun": [95.0, 97.0, 99.0]})
    assert row["native_fa_off"] == {"median": 85.0, "min": 80.0, "max": 90.0}
    assert row["ratio"] == pytest.approx(97.0 / 98.0) and row["pass"]
    assert row["paired"] == pytest.approx(99.0 / 98.0)  # rounds: 95/100, 97/96, 99/98
    row = summarize({"native_fa_off": [100.0], "native_fa_on": [None], "localrun": [96.0]})
    assert row["native_fa_on"] is None and row["ratio"] == pytest.approx(0.96) and not row["pass"]
    assert GOAL == 0.97
    row = summarize({"native_fa_off": [100.0], "native_fa_on": [90.0], "localrun": [None]})
    assert row["ratio"] is None and row["paired"] is None and not row["pass"]


def test_table_shows_medians_ranges_the_choice_and_the_mark():
    ok = {"model": "m.gguf", "threads": 2, "flash_attn": "on", "errors": [],
          **summarize({"native_fa_off": [80.0, 90.0], "native_fa_on": [100.0, 100.0], "localrun": [99.0, 99.0]})}
    bad = {"model": "m.gguf", "threads": 1, "flash_attn": None, "errors": ["localrun: exit 1: boom"],
           **summarize({"native_fa_off": [50.0], "native_fa_on": [40.0], "localrun": [None]})}
    lines = format_table([ok, bad]).splitlines()
    assert [c.strip() for c in lines[0].split(" | ")[2:]] == ["native fa-off", "native fa-on", "localrun",
                                                              "localrun FA", "ratio", "paired", ">= 0.97"]
    assert "85.0 (80.0-90.0)" in lines[2] and "100.0 " in lines[2] and "0.990 | 0.990" in lines[2]
    assert lines[2].rstrip().endswith("PASS") and lines[3].rstrip().endswith("-")
    assert lines[4] == "ERROR m.gguf t=1: localrun: exit 1: boom"


def test_the_chosen_setting_says_when_no_timing_backs_it():
    timed = {"flash_attn": "on", "attention_timing": "flash attention on, measured at 2 thread(s) ..."}
    assert fa_label([timed, timed]) == "on"
    assert fa_label([timed, {"flash_attn": "off", "attention_timing": None}]) == "off untimed/on"
    assert fa_label([]) is None

"""scripts/bench/bench_tools.py in miniature (the benchmark itself runs for minutes and is
not run here): each family's template is given to the engine, its call is timed against
free text of as many tokens, and a reasoning block the template opens is closed first."""

from __future__ import annotations

from scripts.bench.bench_tools import SETTINGS, bench


def test_each_family_is_timed_against_free_text_of_as_many_tokens(smollm2_gguf):
    got = bench(smollm2_gguf, threads=1, n_gen=6, repeat=2, families=["qwen3-coder", "deepseek-r1"])
    assert [row["family"] for row in got["families"]] == ["qwen3-coder", "deepseek-r1"]
    for row in got["families"]:
        for name in SETTINGS:
            r = row[name]
            assert len(r["runs_tools"]) == len(r["runs_free"]) == 2
            assert all(0 < n <= 6 for n in r["tokens"])
            assert r["tools_tps"] > 0 and r["free_tps"] > 0 and len(r["pair_ratios"]) == 2
    qwen3, r1 = got["families"]
    assert qwen3["tools_in_prompt"] and r1["tools_in_prompt"]
    raw, marker = r1["greedy"]["raw_tools"][0], "<｜tool▁calls▁begin｜>"
    assert raw and (marker.startswith(raw) or raw.startswith(marker))  # the call, not thoughts

"""scripts/bench/bench_sampling.py's chain/greedy A/B on a real model, in miniature (the
benchmark itself runs for minutes and is not run here): every step of both settings is
timed, and the pair of speeds is what the generations' own timings report."""

from __future__ import annotations

from scripts.bench.bench_sampling import chain_vs_greedy


def test_chain_vs_greedy_times_every_step_of_both_settings(smollm2_gguf):
    got = chain_vs_greedy(smollm2_gguf, threads=1, n_gen=6, rounds=3)
    # the first token comes with the prompt's step; each later one is a timed step
    assert got["steps"] == {"greedy": 3 * 5, "chain": 3 * 5}
    for name in ("greedy", "chain"):
        us = got["us"][name]
        assert 0 < us["decode wall"] <= us["step wall"]
        assert us["outside decode wall"] > 0
        assert got["tps"][name] > 0
    mean, low, high = got["paired"]
    assert low <= mean <= high

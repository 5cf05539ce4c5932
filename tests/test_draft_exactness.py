"""The pure parts of scripts/bench/draft_exactness.py: the two-sample chi-square."""

from __future__ import annotations

import random
from collections import Counter

from scripts.bench.draft_exactness import chi2_survival, homogeneity


def test_chi2_survival_matches_known_quantiles():
    assert abs(chi2_survival(6.635, 1) - 0.01) < 0.002
    assert abs(chi2_survival(18.307, 10) - 0.05) < 0.005
    assert abs(chi2_survival(9.342, 10) - 0.5) < 0.01
    assert chi2_survival(0.0, 3) == 1.0


def test_homogeneity_accepts_one_law_and_rejects_two():
    rng = random.Random(0)
    law = ["a"] * 50 + ["b"] * 30 + ["c"] * 15 + ["d"] * 4 + ["e"]
    other = ["a"] * 30 + ["b"] * 50 + ["c"] * 15 + ["d"] * 4 + ["e"]
    one = Counter(rng.choice(law) for _ in range(400)), Counter(rng.choice(law) for _ in range(400))
    two = Counter(rng.choice(law) for _ in range(400)), Counter(rng.choice(other) for _ in range(400))
    assert homogeneity(*one)[2] > 0.01
    stat, dof, p = homogeneity(*two)
    assert p < 1e-6 and dof >= 3


def test_rare_outcomes_share_one_cell():
    a = Counter({"x": 40, "r1": 1, "r2": 1})
    b = Counter({"x": 40, "r3": 2})
    _, dof, _ = homogeneity(a, b)
    assert dof == 1  # "x" and the pooled rare ones

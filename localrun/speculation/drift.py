"""Batch drift: how far a wide step's rows stray from one-row steps' on a model, which
bounds what exact greedy verification may trust (speculator.py).

**Temperature 0.** A row computed in a wide step is not always bit-identical to the
same row computed alone: llama.cpp's CPU backend multiplies a many-row batch with other
kernels than one row (llamafile's sgemm for F16/Q8_0/Q4_0 weights and the F16 KV cache,
a tiled kernel for K-quants from 8 rows, the repacked weights' gemm from 4 rows). On this
project's 2-core AVX2 CPU with flash attention off, top-two margins moved by up to ~0.8
on Gemma-3 and SmolLM2 and ~0.3 on Qwen2.5 (scripts/lookup/batch_drift.py). Without all three
(a -DGGML_LLAMAFILE=OFF build, GGML_CPU_TILED_MM=0, no repacking) rows are bit-identical,
but prompt reading gets 1.1x (Q4_1) to 2.1x (K-quants) slower and a wide step 1.6-1.9x
dearer, so localrun keeps the fast kernels. By default a greedy token is taken from a
wide step's row as from a one-row step: a near-tie can go the other way than without
lookup (measured: 26-30 of 36 answers identical from run to run, scripts/bench/bench_lookup.py;
llama-server's n-gram modes kept 34 of the 36 in one same run, drafting only behind a
12-token match, so that open chats rarely take a wide step). With
`LookupConfig(exact_greedy=True)` it bounds the kernels' effect instead: `BatchDrift`
measures the drift on the first speculative steps of a model (by recomputing them one
row at a time, which also decides those tokens exactly), and from then on a greedy
token is taken from a wide step only where it leads the runner-up by more than a margin
over the measured drift; otherwise the step stops there and a one-row step decides (the
draft's judge counts that stop as a rejection: the rows after it are lost all the same).
That protects the wide rows but not the KV cache of kept drafts, which later rows read:
it kept 28-29 of the same 36 answers identical, at 1.23-1.34x the grounded tasks' time.
A fixed lead without the measuring did no better: with 0.2 or 0.5 logits, 28 and 29 of
36, and Gemma-3's rename still parted from lookup off at the same token (its top two 0.07
apart without lookup): a wide row would have had to move by more than 0.57 for the lead
to let it through, so the KV cache is the likelier cause.
"""

from __future__ import annotations

import numpy as np


def margin_change(wide, alone) -> float:
    """How much the lead of a one-row step's top token over its runner-up changed when the
    same row was computed in a wide step (0: the choice between them is as sure)."""
    two = np.argpartition(alone, -2)[-2:]
    return abs(float((wide[two[1]] - wide[two[0]]) - (alone[two[1]] - alone[two[0]])))


class BatchDrift:
    """How far a wide step's rows may stray from one-row steps' on this model: the
    largest change of a top-two margin seen over the first `SAMPLE_ROWS` rows that were
    computed both ways. Until then greedy speculative steps are recomputed one row at a
    time (`calibrating`)."""

    SAMPLE_ROWS = 48
    # A 48-row maximum understates the true one, so the margin is a multiple of it. 1.5
    # covers every row of scripts/lookup/batch_drift.py (4 prompts x 64 tokens, 16-row steps) on
    # the three test models, and it kept as many of 36 answers identical as 2.5 did
    # (32 vs 29, bench_lookup.py --identity-only --threads 1), while 2.5 left so many
    # copied rows to one-row steps that Gemma-3's two code edits decoded at 80 and 63
    # tok/s against 92 and 114 with 1.5 (bench_lookup.py --threads 1).
    SAFETY = 1.5

    def __init__(self) -> None:
        self.rows = 0
        self.worst = 0.0

    @classmethod
    def known(cls, worst: float) -> "BatchDrift":
        """A drift already known (a backend whose rows never depend on the batch: 0)."""
        drift = cls()
        drift.rows, drift.worst = cls.SAMPLE_ROWS, worst
        return drift

    @property
    def calibrating(self) -> bool:
        return self.rows < self.SAMPLE_ROWS

    @property
    def margin(self) -> float:
        """A greedy token from a wide step must lead its runner-up by more than this."""
        return self.SAFETY * self.worst

    def observe(self, wide_margin_change: float) -> None:
        self.rows += 1
        self.worst = max(self.worst, wide_margin_change)

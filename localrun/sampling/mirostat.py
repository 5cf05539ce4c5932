"""Mirostat v1 and v2: truncation to a target surprise mu (the Sampler keeps mu)."""

from __future__ import annotations

import math

import numpy as np

from .stages import _Cands, _logsumexp, _top_indices

_MIROSTAT_M = 100  # llama.cpp's fixed Zipf-estimate window for mirostat v1


def mirostat_v1(c: _Cands, mu: float, n_vocab: int) -> None:
    """Top-k with k from a Zipf exponent fitted on the top m=100 tokens, chosen so the
    expected surprise is mu. The fit uses only ratios of probabilities, i.e. logit
    differences, so no softmax is needed to find k."""
    m = min(_MIROSTAT_M, c.size)
    if m < 2:
        return
    head = _top_indices(c.logits, m)
    top = np.sort(np.asarray(c.logits[head], dtype=np.float64))[::-1]
    i = np.arange(m - 1, dtype=np.float64)
    t = np.log((i + 2) / (i + 1))
    b = top[:-1] - top[1:]  # ln(p_i / p_i+1)
    with np.errstate(all="ignore"):  # numpy floats: a huge mu gives inf, where 2.0**mu would raise
        s_hat = np.sum(t * b) / np.sum(t * t)
        eps = s_hat - 1
        k = float(((eps * np.exp2(np.float64(mu))) / (1 - np.float64(n_vocab) ** -eps)) ** (1 / s_hat))
    # llama.cpp's int(k) of nan or inf ends at 1 too (x86's cvttss2si gives INT_MIN)
    k = max(int(k), 1) if math.isfinite(k) else 1
    if k < c.size:
        c.top(k)


def mirostat_v2(c: _Cands, mu: float) -> None:
    """Keep the tokens whose surprise -log2 p is at most mu (at least the top one):
    log p = logit - logsumexp >= -mu ln 2, a test on the logits themselves."""
    x = np.asarray(c.logits, dtype=np.float32)
    keep = x >= _logsumexp(x) - mu * math.log(2)
    if not keep.any():
        keep = x == x.max()
    c.keep(keep, c.sorted)

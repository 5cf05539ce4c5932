"""The sampler chain, shared by every backend, applied to one numpy logits row.

Order (llama.cpp's default, minus the stages a later issue adds):

    penalties -> logit bias -> top-k -> top-p -> min-p -> temperature -> draw

* penalties (repetition, presence, frequency) and logit bias CAN change the argmax, so
  they run even when greedy.
* top-k, top-p, min-p and temperature never change the argmax: at temperature <= 0 the
  chain stops after logit bias and takes the argmax (no softmax, no copy when there is
  nothing to penalise).
* truncation works on a small candidate set: top-k first with `argpartition` (O(V)),
  so the softmax and sort touch k entries, not the whole 49k..262k vocabulary.

Each stage is a small pure function on (ids, logits) candidate arrays; `Sampler` is a
thin stateful shell (the RNG) that a speculative verifier can snapshot and restore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from .errors import BadRequestError


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and math.isnan(v):
                raise BadRequestError(f"{f.name} is NaN; give a number")
        if self.temperature < 0:
            raise BadRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < -1:
            raise BadRequestError(f"top_k must be 0 or -1 (off) or a positive count, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise BadRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise BadRequestError(f"repeat_penalty must be > 0 (1 = off), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise BadRequestError(f"repeat_last_n must be -1 (whole context), 0 (off) or a count, got {self.repeat_last_n}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or isinstance(bias, float) and math.isnan(bias):
                raise BadRequestError(f"logit_bias must map token ids to numbers, got {tok!r}: {bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


# -- stages: each takes and returns candidate arrays ---------------------------------


def apply_penalties(logits: np.ndarray, history: list[int], p: SamplingParams) -> None:
    """In place, llama.cpp semantics: repetition divides positive logits and multiplies
    negative ones; presence subtracts once per seen token, frequency once per occurrence."""
    window = history if p.repeat_last_n == -1 else history[-p.repeat_last_n :]
    if not window:
        return
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    ids_ok = ids[(ids >= 0) & (ids < logits.shape[0])]
    counts = counts[(ids >= 0) & (ids < logits.shape[0])]
    vals = logits[ids_ok]
    if p.repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    vals = vals - counts * p.frequency_penalty - p.presence_penalty
    logits[ids_ok] = vals


def apply_logit_bias(logits: np.ndarray, bias: dict[int, float]) -> None:
    for tok, b in bias.items():
        if 0 <= tok < logits.shape[0]:
            logits[tok] += b


def top_k(ids: np.ndarray, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the k largest logits, sorted descending. k <= 0 keeps all (sorted)."""
    if 0 < k < logits.shape[0]:
        part = np.argpartition(-logits, k - 1)[:k]
        ids, logits = ids[part], logits[part]
    order = np.argsort(-logits, kind="stable")
    return ids[order], logits[order]


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits[0] if logits.size else logits)  # candidates are sorted: [0] is max
    return e / e.sum()


def top_p(ids: np.ndarray, logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep the shortest sorted prefix whose probability mass reaches p (at least one)."""
    if p >= 1.0 or ids.size <= 1:
        return ids, logits
    cum = np.cumsum(softmax(logits))
    n = int(np.searchsorted(cum, p, side="left")) + 1
    return ids[:n], logits[:n]


def min_p(ids: np.ndarray, logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep tokens whose probability is at least p times the top one's: a logit test,
    logit >= max + ln(p), so no softmax is needed."""
    if p <= 0.0 or ids.size <= 1:
        return ids, logits
    keep = logits >= logits[0] + math.log(p)
    return ids[keep], logits[keep]


class Sampler:
    """One generation's sampler: params plus the RNG state."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def snapshot(self) -> dict:
        return self.rng.bit_generator.state

    def restore(self, state: dict) -> None:
        self.rng.bit_generator.state = state

    def adjusted(self, row: np.ndarray, history: list[int]) -> np.ndarray:
        """The row after the argmax-changing stages; the backend's buffer is never written."""
        p = self.params
        if not (p.penalizes or p.logit_bias):
            return row
        logits = np.array(row, dtype=np.float32, copy=True)
        if p.penalizes:
            apply_penalties(logits, history, p)
        if p.logit_bias:
            apply_logit_bias(logits, p.logit_bias)
        return logits

    def candidates(self, row: np.ndarray, history: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and their final probabilities after every stage (sorted, descending)."""
        p = self.params
        logits = self.adjusted(row, history)
        if p.greedy:
            best = int(np.argmax(logits))
            return np.array([best]), np.array([1.0])
        ids, cand = top_k(np.arange(logits.shape[0]), np.asarray(logits, dtype=np.float32), p.top_k)
        ids, cand = top_p(ids, cand, p.top_p)
        ids, cand = min_p(ids, cand, p.min_p)
        return ids, softmax(cand / p.temperature)

    def sample(self, row: np.ndarray, history: list[int]) -> int:
        if self.params.greedy:
            return int(np.argmax(self.adjusted(row, history)))
        ids, probs = self.candidates(row, history)
        return int(ids[int(self.rng.choice(ids.size, p=probs))])

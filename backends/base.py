"""The backend seam.

A backend runs the network and holds KV state for a few numbered sequences. It knows
nothing of sampling, grammars, speculation, chat templates or HTTP: the engine does all
of that once, on the logits rows a backend returns.

One `decode` call takes several sequences at once. Each `BatchEntry` gives a sequence
id, the tokens to append to that sequence's KV cache starting at position `pos`, and
how many of the final rows it wants logits for (1 for a normal step; k+1 to verify k
draft tokens; 0 for a prefill chunk that is not the last). The returned arrays are
views into the backend's own buffers, valid until the next `decode`; copy what you keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from localrun.model.formats import check_kv_cache_type


# The tokens one decode may carry unless the caller says otherwise (Engine.open, run,
# chat, fit); `serve --batch` defaults to less. llama.cpp sizes its compute buffers by it.
DEFAULT_N_BATCH = 512


@dataclass(frozen=True)
class BackendOptions:
    """How to load a model, one value for every backend (open_backend, Engine.open and the
    constructors take these fields as keywords, or the object itself as `options`).

    n_ctx: tokens per sequence (None: the model's training context, at most 4096);
    n_seq: sequences decoded together; n_batch: tokens one decode may carry;
    kv_cache_type: "f16", "q8_0" or "q4_0" (None: f16), the KV cache's element type.
    llama.cpp's own: threads (None: fitted to the cores others leave free), n_gpu_layers
    (-1: every layer on the GPU where one exists), cluster (a localrun.cluster.rpc.Cluster:
    RPC workers to split the model over), repack (the CPU's gemm weight layouts),
    flash_attn ("on" or "off": that attention kernel, not the one measured or llama.cpp's
    choice; for numbers that must not depend on it, as quant/quality.py's comparisons).
    MLX's own: trust_remote_code (import the Python code a model folder names).
    A backend refuses, in one line, a value that means nothing to it."""

    n_ctx: int | None = None
    n_seq: int = 1
    n_batch: int = DEFAULT_N_BATCH
    kv_cache_type: str | None = "f16"
    threads: int | None = None
    n_gpu_layers: int = -1
    cluster: object | None = None  # localrun.cluster.rpc.Cluster (not imported: the foundations stay light)
    repack: bool = True
    flash_attn: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_type", check_kv_cache_type(self.kv_cache_type))
        if self.flash_attn not in (None, "on", "off"):
            raise ValueError(f"flash_attn must be 'on', 'off' or None, got {self.flash_attn!r}")
        if self.flash_attn == "off" and self.kv_cache_type != "f16":
            raise ValueError(f"a {self.kv_cache_type} KV cache needs flash attention on")

    @classmethod
    def of(cls, options: "BackendOptions | None" = None, **fields) -> "BackendOptions":
        """`options`, or one made of `fields` (a constructor's keywords); not both."""
        if options is None:
            return cls(**fields)
        if fields:
            raise TypeError(f"pass BackendOptions or keyword options, not both (got {', '.join(sorted(fields))})")
        return options

    def changed(self) -> dict:
        """The fields that differ from their defaults."""
        default = BackendOptions()
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if getattr(self, f) != getattr(default, f)}


@dataclass(frozen=True)
class ModelInfo:
    path: str
    backend: str  # "llama.cpp" | "mlx"
    architecture: str
    n_vocab: int
    n_ctx_train: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    sliding_window: int | None
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    add_bos: bool
    # every id that ends a turn: eos, eot, and the template's end-of-turn markers
    stop_ids: frozenset[int]
    chat_template: str | None
    bos_text: str
    eos_text: str
    quant: str  # "Q4_1", "F16", "4bit", ...
    fim_prefix_id: int | None = None
    fim_suffix_id: int | None = None
    fim_middle_id: int | None = None
    n_params: int = 0
    size_bytes: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class BatchEntry:
    seq: int
    tokens: Sequence[int]
    pos: int
    n_logits: int = 1  # how many trailing rows need logits (0..len(tokens))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (a slot's cached tokens and a prompt)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@runtime_checkable
class Backend(Protocol):
    """Everything the engine, the scheduler, the server and the grammar read from a
    backend; nothing else is read. tests/test_backend_contract.py checks that each
    backend, and the scripted fake, declares every member here with its type and
    parameter names.

    Errors: a constructor that cannot load raises ModelLoadError; `decode` raises
    DecodeInterrupted (after `interrupt`) or DecodeError (the pass failed), leaving every
    cache as it was; `kv_trim` raises CacheNotTrimmableError when the cache cannot be
    cut (the caller clears the sequence and reads its history again instead).
    """

    name: str  # "llama.cpp" | "mlx"
    info: ModelInfo
    n_vocab: int  # rows of logits are this wide (= info.n_vocab)
    n_ctx: int  # context size of each sequence
    n_seq: int  # how many sequences may be live at once
    n_batch: int  # most tokens one decode call may carry in total
    kv_cache_type: str  # the KV cache's element type: "f16", "q8_0" or "q4_0"
    # True when `interrupt` can stop a decode mid-pass; a backend without it gets short
    # prompt chunks from the scheduler instead, so a waiting stream is not held long
    can_interrupt: bool
    # True when one decode computes together only sequences with consecutive ids, and
    # each gap costs another forward pass (llama.cpp's KV stream per sequence); the
    # engine then keeps busy slots adjacent (localrun/slots.py)
    batches_neighbours_only: bool

    def passes(self, counts: Sequence[int]) -> list[int]:
        """The forward passes a step of `counts` tokens per sequence (by sequence id)
        runs as, in rows per pass: what a draft's rows cost in a shared step
        (speculation.proposer.StepShare)."""
        ...

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a token stands for; empty for control tokens."""
        ...

    def is_control(self, token: int) -> bool: ...

    def token_text(self, token: int) -> str:
        """The vocabulary's own spelling of a token (names special tokens for grammars)."""
        ...

    def decode(self, batch: Sequence[BatchEntry]) -> list[np.ndarray]:
        """Run one forward pass over every entry; one [n_logits, n_vocab] float32 array each."""
        ...

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """A normalised embedding of `tokens` (mean of the last hidden states)."""
        ...

    def interrupt(self) -> None:
        """Abort the decode in flight, or the next one, from any thread: that `decode`
        raises DecodeInterrupted and leaves every KV cache as it was before the call.
        A backend that cannot stop mid-pass has `can_interrupt = False` and ignores it."""
        ...

    def clear_interrupt(self) -> None:
        """Withdraw an `interrupt()` that came after the decode it was meant for had
        already finished, so it cannot abort the next decode (other clients' step)."""
        ...

    def kv_trim(self, seq: int, n_keep: int) -> None:
        """Drop every cached position >= n_keep of `seq`; CacheNotTrimmableError when
        this cache cannot be cut (nothing is dropped then)."""
        ...

    def kv_copy(self, src: int, dst: int, n: int) -> None:
        """Make dst's cache hold src's first n positions (dst's old content is dropped)."""
        ...

    def kv_clear(self, seq: int) -> None: ...

    def kv_tokens(self, seq: int) -> Sequence[int]:
        """The tokens `seq`'s KV holds, in position order (what a new prompt may reuse)."""
        ...

    def kv_state_bytes(self, seq: int) -> int:
        """Bytes `seq`'s cached positions occupy in the cache's element type (what
        `--kv-cache-type` saves; the caches' spare capacity is not counted)."""
        ...

    def close(self) -> None: ...


class DecodeInterrupted(Exception):
    """`decode` was stopped by `interrupt()`; nothing it was given was kept."""


class KvLedger:
    """Which tokens each sequence's KV cache holds, kept beside the cache by the backend
    that owns it, so whoever reuses a cached prefix checks against the truth (not
    against its own memory of what it once fed)."""

    def __init__(self, n_seq: int) -> None:
        self._kv: list[list[int]] = [[] for _ in range(n_seq)]

    def fed(self, batch: Sequence[BatchEntry]) -> None:
        for e in batch:
            self._kv[e.seq][e.pos :] = map(int, e.tokens)

    def trimmed(self, seq: int, n_keep: int) -> None:
        del self._kv[seq][max(0, n_keep) :]

    def copied(self, src: int, dst: int, n: int) -> None:
        self._kv[dst] = self._kv[src][:n]

    def cleared(self, seq: int) -> None:
        self._kv[seq] = []

    def tokens(self, seq: int) -> list[int]:
        return self._kv[seq]


def neighbour_passes(counts: Sequence[int]) -> list[int]:
    """The forward passes llama.cpp splits a step into, as rows per pass, for the tokens
    each sequence feeds (`counts`, by sequence id): with a KV stream per sequence
    (split_equal, sequential), a pass takes the run of consecutive sequence ids from the
    first with tokens left, the same number of tokens from each: the fewest any of them
    has left. So 1, 1+k, 1, 1 tokens make passes of 4 and k rows."""
    left, out = list(counts), []
    first = 0
    while True:
        while first < len(left) and not left[first]:
            first += 1
        if first == len(left):
            return out
        end = first
        while end + 1 < len(left) and left[end + 1]:
            end += 1
        take = min(left[first : end + 1])
        out.append(take * (end + 1 - first))
        for s in range(first, end + 1):
            left[s] -= take


def check_batch(batch: Sequence[BatchEntry], n_seq: int, n_ctx: int, n_batch: int) -> int:
    """Validate a batch against a backend's limits; returns the total token count."""
    total = 0
    seen = set()
    for e in batch:
        if not 0 <= e.seq < n_seq:
            raise ValueError(f"sequence id {e.seq} outside 0..{n_seq - 1}")
        if e.seq in seen:
            raise ValueError(f"sequence {e.seq} appears twice in one batch")
        seen.add(e.seq)
        if not e.tokens:
            raise ValueError(f"sequence {e.seq}: empty token list")
        if not 0 <= e.n_logits <= len(e.tokens):
            raise ValueError(f"sequence {e.seq}: n_logits {e.n_logits} not in 0..{len(e.tokens)}")
        if e.pos < 0 or e.pos + len(e.tokens) > n_ctx:
            raise ValueError(f"sequence {e.seq}: positions {e.pos}..{e.pos + len(e.tokens)} exceed n_ctx {n_ctx}")
        total += len(e.tokens)
    if total > n_batch:
        raise ValueError(f"batch of {total} tokens exceeds n_batch {n_batch}")
    return total

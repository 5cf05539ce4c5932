"""A scripted backend for engine logic that needs exact logits.

Vocabulary: ids 0..255 are single bytes, 256 is EOS. `script(history) -> next token`
decides the argmax; the row puts logit 10 there and 0 elsewhere (or uses `dist` to
return a fixed distribution). It records every decode call so tests can assert what
the engine asked of it. It declares every member of `backends.base.Backend`
(tests/test_backend_contract.py holds it to the same list as the real backends).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from localrun.backends.base import BatchEntry, ModelInfo, check_batch, neighbour_passes

EOS = 256
N_VOCAB = 257
# K and V, f16, for make_info's one layer of one KV head of width 8
KV_BYTES_PER_TOKEN = 2 * 1 * 1 * 8 * 2


def make_info(**over) -> ModelInfo:
    base = dict(
        path="<fake>", backend="fake", architecture="fake", n_vocab=N_VOCAB, n_ctx_train=1024,
        n_layer=1, n_head=1, n_head_kv=1, head_dim=8, sliding_window=None, bos_id=None,
        eos_id=EOS, eot_id=None, add_bos=False, stop_ids=frozenset({EOS}), chat_template=None,
        bos_text="", eos_text="", quant="F32",
    )
    base.update(over)
    return ModelInfo(**base)


class ScriptedBackend:
    name = "fake"
    n_vocab = N_VOCAB
    kv_cache_type = "f16"

    def __init__(
        self,
        script: Callable[[list[int]], int] | None = None,
        n_ctx: int = 64,
        n_seq: int = 2,
        n_batch: int = 16,
        logits_fn: Callable[[list[int]], np.ndarray] | None = None,
        batches_neighbours_only: bool = False,
    ) -> None:
        self.batches_neighbours_only = batches_neighbours_only
        self.script = script or (lambda hist: EOS)
        self.logits_fn = logits_fn
        self.n_ctx, self.n_seq, self.n_batch = n_ctx, n_seq, n_batch
        self.info = make_info()
        self.kv: dict[int, list[int]] = {s: [] for s in range(n_seq)}
        self.calls: list[list[BatchEntry]] = []
        self.trim_error: Exception | None = None  # raised by a kv_trim that would drop positions

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else b""

    def is_control(self, token: int) -> bool:
        return token >= 256

    def token_text(self, token: int) -> str:
        return "</s>" if token == EOS else bytes([token]).decode("latin-1")

    def _row(self, hist: list[int]) -> np.ndarray:
        if self.logits_fn is not None:
            return np.asarray(self.logits_fn(hist), dtype=np.float32)
        row = np.zeros(N_VOCAB, np.float32)
        row[self.script(hist)] = 10.0
        return row

    def decode(self, batch: Sequence[BatchEntry]) -> list[np.ndarray]:
        check_batch(batch, self.n_seq, self.n_ctx, self.n_batch)
        self.calls.append(list(batch))
        out = []
        for e in batch:
            kv = self.kv[e.seq]
            assert e.pos == len(kv), f"seq {e.seq}: decode at {e.pos} but KV holds {len(kv)}"
            kv.extend(e.tokens)
            rows = [self._row(kv[: e.pos + i + 1]) for i in range(len(e.tokens) - e.n_logits, len(e.tokens))]
            out.append(np.stack(rows) if rows else np.empty((0, N_VOCAB), np.float32))
        return out

    def passes(self, counts: Sequence[int]) -> list[int]:
        """llama.cpp's split where it batches neighbours only, else one pass."""
        return neighbour_passes(counts) if self.batches_neighbours_only else [sum(counts)] if any(counts) else []

    def kv_trim(self, seq: int, n_keep: int) -> None:
        if self.trim_error is not None and len(self.kv[seq]) > n_keep:
            raise self.trim_error
        del self.kv[seq][n_keep:]

    def kv_copy(self, src: int, dst: int, n: int) -> None:
        self.kv[dst] = list(self.kv[src][:n])

    def kv_clear(self, seq: int) -> None:
        self.kv[seq] = []

    can_interrupt = False  # decode is instant here; nothing to stop

    def interrupt(self) -> None:
        """Nothing runs long enough to stop."""

    def clear_interrupt(self) -> None:
        """Nothing to withdraw."""

    def kv_tokens(self, seq: int) -> list[int]:
        return self.kv[seq]

    def kv_state_bytes(self, seq: int) -> int:
        return len(self.kv[seq]) * KV_BYTES_PER_TOKEN

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """How often each token occurs, L2-normalised: equal bags of tokens embed alike."""
        if not 0 < len(tokens) <= self.n_ctx:
            raise ValueError(f"embed: {len(tokens)} tokens, expected 1..{self.n_ctx}")
        vec = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=N_VOCAB).astype(np.float32)
        return vec / np.linalg.norm(vec)

    def close(self) -> None:
        pass


def text_script(answer: bytes) -> Callable[[list[int]], int]:
    """A script that, after any prompt, emits `answer` byte by byte, then EOS."""

    state: dict[str, int] = {}

    def script(hist: list[int]) -> int:
        start = state.setdefault("start", len(hist))  # the first call sees the whole prompt
        i = len(hist) - start
        return answer[i] if i < len(answer) else EOS

    return script


def step_all(engine, gens) -> None:
    """Step generations together until all are done, releasing each as it finishes (as
    the server's scheduler does, so its slot is free for the others to move into)."""
    live = list(gens)
    while live:
        engine.step(live)
        for g in [g for g in live if g.done]:
            engine.release(g)
            live.remove(g)

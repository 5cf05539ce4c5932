"""The child side of `remote.RemoteBackend`: a process that owns one llama.cpp context
split over RPC workers and answers the parent's calls over two pipes.

Why a process of its own: when a worker dies, ggml-rpc's client calls `GGML_ABORT` on its
own threads and the process ends (localrun/cluster/rpc.py's abort hook makes that an `error:`
line and exit code 3). Here that process is this child, so the server that started it
sees the pipe close and fails only the answers that used this model.

Two pipes, each served by one thread:
- `main`: decode, the KV-cache calls, embed, close (the scheduler's thread in the parent);
- `side`: tokenize and token_text, which the parent calls from request threads while a
  decode may be running, as they would in-process (llama.cpp's vocabulary is read-only).

Replies are pickled `("ok", value)` / `("raise", exception)`. A decode's logits rows do
not go through pickle: they are copied into a block of memory the parent allocated and
both map (a multiprocessing RawArray: unlinked at once, so a killed child leaves nothing
behind), and the answer is `("ok", "shared")`; the parent returns views of it. Rows that
do not fit the block follow the answer `("ok", None)` as raw pipe messages, one per entry.
The interrupt flag is the parent's shared byte, read by llama.cpp's abort callback in here
(`HostedLlamaCpp`), so `interrupt()` stops a decode mid-pass as it does in-process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import numpy as np

from localrun.errors import DecodeError

from .base import BatchEntry
from .llamacpp import LlamaCppBackend, _lc

# what the parent may call on the main pipe (anything else is a bug there)
MAIN_CALLS = frozenset({"decode", "kv_trim", "kv_copy", "kv_clear", "kv_tokens", "kv_state_bytes", "embed", "close"})
SIDE_CALLS = frozenset({"tokenize", "token_text"})


class HostedLlamaCpp(LlamaCppBackend):
    """The llama.cpp backend whose interrupt flag is a byte the parent process writes."""

    def __init__(self, path: str, shared_flag: ctypes.Array, **options) -> None:
        self._shared_flag = shared_flag
        super().__init__(path, **options)

    def _arm_interrupt(self, ctx) -> None:
        super()._arm_interrupt(ctx)
        # the same abort callback (strlen over a 2-byte flag), pointed at the shared byte;
        # decode() clears it after each pass through `_abort_flag`, as in-process
        self._abort_flag = self._shared_flag
        _lc.llama_set_abort_callback(ctx, self._abort_fn, ctypes.cast(self._shared_flag, ctypes.c_void_p))


def vocabulary(backend: LlamaCppBackend) -> dict:
    """What the parent answers without a round trip: every token's bytes, the control
    tokens, and the spelling of tokens whose bytes are empty (grammars name them)."""
    pieces = [backend.token_bytes(t) for t in range(backend.n_vocab)]
    control = [t for t in range(backend.n_vocab) if backend.is_control(t)]
    named = {t: backend.token_text(t) for t in set(control) | {t for t, p in enumerate(pieces) if not p}}
    return {"pieces": pieces, "control": control, "texts": named}


def facts(backend: LlamaCppBackend) -> dict:
    return {"info": backend.info, "n_vocab": backend.n_vocab, "n_ctx": backend.n_ctx, "n_seq": backend.n_seq,
            "n_batch": backend.n_batch, "kv_cache_type": backend.kv_cache_type, "threads": backend.threads,
            "placement": backend.placement, **vocabulary(backend)}


def _send_raise(conn, exc: BaseException) -> None:
    try:
        conn.send(("raise", exc))
    except Exception:  # an exception that does not pickle: its text still reaches the parent
        conn.send(("raise", DecodeError(f"{type(exc).__name__}: {exc}")))


def _serve(conn, backend: LlamaCppBackend, allowed: frozenset, shared: np.ndarray | None = None) -> None:
    """Answer calls until the parent says close or hangs up (EOF: it exited or gave up on us).
    `shared`: the [rows, n_vocab] block the parent reads a decode's logits from when they fit."""
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op not in allowed:
            _send_raise(conn, RuntimeError(f"{op} is not a call this host answers"))
            continue
        try:
            if op == "decode":
                rows = backend.decode([BatchEntry(*entry) for entry in args])
            else:
                value = getattr(backend, op)(*args)
        except Exception as exc:  # DecodeInterrupted, DecodeError, CacheNotTrimmableError, ValueError: the caller's
            _send_raise(conn, exc)
            continue
        if op == "decode":
            if shared is not None and sum(len(r) for r in rows) <= len(shared):
                at = 0
                for r in rows:  # in the batch's order, as the parent slices them
                    shared[at : at + len(r)] = r
                    at += len(r)
                conn.send(("ok", "shared"))
                continue
            conn.send(("ok", None))
            for r in rows:
                if len(r):
                    conn.send_bytes(memoryview(r).cast("B"))  # contiguous rows of the output buffer
        else:
            conn.send(("ok", value))
        if op == "close":
            return


PARENT_CHECK_S = 1.0  # how often the child looks whether its parent is still there


def _exit_with_parent(parent: int) -> None:
    """End this child when the server that started it is gone, even mid-decode on a hung
    worker (the pipe's EOF is only seen between calls). A parent that exits reparents us."""
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(0)


def host_main(path: str, options: dict, endpoints: list[tuple[str, int]], tensor_split, main, side, flag,
              shared_rows=None, shared_shape: tuple[int, int] = (0, 0)) -> None:
    """The child's entry point (multiprocessing, spawn): register the workers in this
    process, load, report ("ready", facts) or ("raise", error), then serve both pipes.
    shared_rows: a RawArray of shared_shape float32 for the logits (None: the pipe only)."""
    # Ctrl+C in a terminal reaches the whole process group: the parent decides when this
    # child stops (close, or a kill after its own shutdown), never the keyboard
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="localrun-rpc-host parent watch",
                     daemon=True).start()
    from localrun.cluster import rpc

    try:
        cluster = rpc.connect([rpc.Endpoint(h, p) for h, p in endpoints], tensor_split)  # probes first: one-line errors
        backend = HostedLlamaCpp(path, flag, cluster=cluster, **options)
        ready = facts(backend)
        fits = shared_rows is not None and shared_shape[1] == backend.n_vocab
        shared = np.frombuffer(shared_rows, np.float32).reshape(shared_shape) if fits else None
        ready["shared_rows"] = fits
    except Exception as exc:  # RpcError, ModelLoadError, ...: the parent raises it
        _send_raise(main, exc)
        return
    main.send(("ready", ready))
    threading.Thread(target=_serve, args=(side, backend, SIDE_CALLS), name="localrun-rpc-host side",
                     daemon=True).start()
    try:
        _serve(main, backend, MAIN_CALLS, shared)
    finally:
        backend.close()

"""A GGUF split over llama.cpp RPC workers, hosted in a child process (subprocess_host.py)
and driven through the Backend protocol from here.

Why: ggml-rpc's client ends its process (`GGML_ABORT`) when a worker's socket dies, and
waits forever on a worker that vanished without closing its socket. In the child, the
first ends the child, which this side sees as the pipe closing; the second is a call
that gives no answer within `call_timeout`, after which this side kills the child. Either
way the call in flight, and every later call, raises `WorkerLostError`, whose message
names the worker that no longer accepts connections and says to restart it; the server
then drops this backend and loads the model again on its next request
(localrun/server/models.py). `localrun serve --rpc` uses this; `run` and `chat` keep the
model in-process, where rpc.py's abort hook already ends them with one `error:` line.

Cost per decode: one pickled call and answer on a local pipe; the logits rows are written
by the child into memory both processes map and read here in place; the vocabulary
(token bytes, control tokens) is copied once at load, so detokenizing, grammars and DRY
never cross the pipe, and the KV ledger is kept on this side too (the child keeps its
own; they see the same calls).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import threading
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import Sequence

import numpy as np

from localrun.cluster import rpc
from localrun.errors import BadRequestError, DecodeError, LocalrunError, ModelLoadError

from .base import BackendOptions, BatchEntry, KvLedger, ModelInfo, check_batch, neighbour_passes

_log = logging.getLogger("localrun")

# A decode (or any call) that takes longer ends the child: a worker that vanished without
# closing its socket never answers. Generous, since the first decode of a long prompt on a
# slow worker may take a while; `serve --rpc-timeout` (or LOCALRUN_RPC_CALL_TIMEOUT_S) overrides it.
CALL_TIMEOUT_S = 120.0
# Loading sends every offloaded weight to the workers (tens of GB over a LAN for a big model).
LOAD_TIMEOUT_S = 1800.0
CLOSE_WAIT_S = 10.0  # for the child to free the model and exit on close(), then it is killed
REACH_TIMEOUT_S = 1.0  # per worker, when finding which one is gone
# Logits rows travel through memory both processes map: one row per sequence plus a
# lookup draft's (speculation/lookup.py drafts at most 32), within SHARED_ROWS_BYTES; a decode
# that asks for more rows sends them through the pipe instead.
SHARED_ROWS_PER_SEQ = 33
SHARED_ROWS_BYTES = 32 << 20
# Tokenizing runs in the child, on the side pipe, one text at a time (~1.6 MB/s: 7.5 MB
# took 4.7 s on SmolLM2's vocabulary), so every tokenize of the model waits for the one
# before it. A text is refused beyond TOKENIZE_MAX_BYTES (the server's default body limit:
# no request under it holds a longer text; ~5 s of tokenizing), and a tokenize or
# token_text call that gives no answer within TOKENIZE_TIMEOUT_S (or the call timeout, if
# shorter) fails its own request only: tokenizing never touches a worker, so a slow one
# says nothing about them, and the child and its model stay.
TOKENIZE_MAX_BYTES = 8 << 20
TOKENIZE_TIMEOUT_S = 30.0


class WorkerLostError(DecodeError):
    """The process hosting an RPC-split model died or stopped answering: a worker is gone
    (or hangs). The answer in flight ends; the model loads again on the next request."""

    http_status = 503


class SideCallTimeoutError(LocalrunError):
    """A tokenize (or token_text) call in the model's child process took too long; the
    request that asked fails, the model and its workers are untouched."""

    http_status = 503


def parse_call_timeout(text: str) -> float:
    """Seconds above 0 from `text`; "inf" (no bound) is allowed. ValueError otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:  # also refuses nan
        raise ValueError(f"must be a number of seconds above 0, or inf to wait as long as a call takes; got {text!r}")
    return value


# `serve --rpc-timeout`: set once at start-up for every model the process hosts over its
# workers, like the workers `--rpc` registers; None: not given.
_call_timeout_flag: float | None = None


def set_call_timeout(seconds: float | None) -> None:
    """The call timeout of every RemoteBackend opened from now on without its own
    (float("inf"): no bound; None: back to LOCALRUN_RPC_CALL_TIMEOUT_S or the default);
    it wins over LOCALRUN_RPC_CALL_TIMEOUT_S."""
    global _call_timeout_flag
    if seconds is not None and not seconds > 0:
        raise ValueError(f"the RPC call timeout must be above 0 seconds, got {seconds!r}")
    _call_timeout_flag = seconds


def call_timeout_default() -> float | None:
    """The --rpc-timeout seconds, else LOCALRUN_RPC_CALL_TIMEOUT_S, else CALL_TIMEOUT_S;
    None for "inf" (wait as long as a call takes)."""
    value = _call_timeout_flag
    if value is None:
        raw = os.environ.get("LOCALRUN_RPC_CALL_TIMEOUT_S")
        if not raw:
            return CALL_TIMEOUT_S
        try:
            value = parse_call_timeout(raw)
        except ValueError as exc:
            raise ModelLoadError(f"LOCALRUN_RPC_CALL_TIMEOUT_S {exc}") from None
    return None if value == float("inf") else value


def is_lost(backend) -> bool:
    """True for a RemoteBackend whose child has died: its engine must be dropped."""
    return isinstance(backend, RemoteBackend) and backend.lost is not None


def accepts(endpoint: str, timeout: float = REACH_TIMEOUT_S) -> bool:
    """Whether a worker's port still accepts a connection: rpc.accepts, waiting
    REACH_TIMEOUT_S per worker when finding which one a lost host process lost."""
    return rpc.accepts(endpoint, timeout)


def lost_message(cause: str, endpoints: Sequence[str], gone: Sequence[str]) -> str:
    """The one line for a lost host process: `gone` are the workers that no longer accept
    a connection (the likely cause), `cause` what the process did."""
    if gone:
        restart = "; ".join(f"restart `localrun rpc-worker` on {ep}" for ep in gone)
        who = "worker" if len(gone) == 1 else "workers"
        return (f"lost the RPC {who} at {', '.join(gone)} (the process running the model {cause}): {restart};"
                " the next request loads the model again")
    return (f"the process running the model over the RPC workers {cause}; every worker ({', '.join(endpoints)})"
            " still accepts connections, so one of them hangs or failed inside: check their output and restart"
            " the one that hangs (`localrun rpc-worker`); the next request loads the model again")


def _shared_rows_shape(path, n_seq: int) -> tuple[int, int]:
    """(rows, n_vocab) of the shared logits block, from the GGUF header's vocabulary; (0, 0)
    when the header does not say."""
    from localrun.model.facts import facts

    n_vocab = facts(str(path)).n_vocab or 0
    if not n_vocab:
        return 0, 0
    rows = max(1, min(n_seq * SHARED_ROWS_PER_SEQ, SHARED_ROWS_BYTES // (4 * n_vocab)))
    return rows, n_vocab


class RemoteBackend:
    """The Backend protocol over a child process running LlamaCppBackend with workers."""

    name = "llama.cpp"
    can_interrupt = True
    batches_neighbours_only = True
    passes = staticmethod(neighbour_passes)

    def __init__(self, path: str | os.PathLike, options: BackendOptions | None = None,
                 call_timeout: float | None = None, load_timeout: float = LOAD_TIMEOUT_S, **fields) -> None:
        """`options` (or its fields as keywords): LlamaCppBackend's, whose `cluster` (the
        RPC workers to split over) is required here; the child connects to the same
        workers and loads with the rest. call_timeout: seconds a call may take before the
        child is given up (default: call_timeout_default(); inf: no bound)."""
        from . import subprocess_host

        o = BackendOptions.of(options, **fields)
        cluster = o.cluster
        if cluster is None:
            raise ValueError("RemoteBackend needs RPC workers: pass cluster= (rpc.connect's Cluster)")
        # what crosses to the child: plain values (a Cluster holds this process's ctypes handles)
        options = {k: v for k, v in o.changed().items() if k not in ("cluster", "trust_remote_code")}
        if call_timeout is None:
            call_timeout = call_timeout_default()
        elif not call_timeout > 0:
            raise ValueError(f"call_timeout must be above 0 seconds (inf: no bound), got {call_timeout!r}")
        elif call_timeout == float("inf"):
            call_timeout = None
        self.call_timeout = call_timeout  # None: no bound
        self.endpoints = [str(w.endpoint) for w in cluster.workers]
        self.lost: str | None = None  # why the child is gone, once it is
        self._main_lock = threading.Lock()  # one call at a time per pipe
        self._side_lock = threading.Lock()
        self._side_owed = 0  # answers of side calls given up on, still to come (read and dropped)
        self._state_lock = threading.Lock()
        self._rows = np.empty((0, 0), np.float32)
        ctx = mp.get_context("spawn")  # a fresh interpreter: this one may run threads and llama.cpp
        self._flag = ctx.RawArray(ctypes.c_char, 2)  # the interrupt byte, read by the child's abort callback
        shared_shape = _shared_rows_shape(path, int(options.get("n_seq", 1)))
        shared = ctx.RawArray(ctypes.c_float, shared_shape[0] * shared_shape[1]) if shared_shape[0] else None
        self._main, main_child = ctx.Pipe()
        self._side, side_child = ctx.Pipe()
        self._proc = ctx.Process(
            target=subprocess_host.host_main, name=f"localrun-rpc-host {Path(path).name}", daemon=True,
            args=(str(path), options, [(w.endpoint.host, w.endpoint.port) for w in cluster.workers],
                  cluster.tensor_split, main_child, side_child, self._flag, shared, shared_shape))
        self._proc.start()
        main_child.close()  # only the child holds its ends now: its exit closes the pipes
        side_child.close()
        try:
            status, value = self._receive(self._main, load_timeout, "while loading the model")
        except WorkerLostError as exc:
            raise ModelLoadError(str(exc)) from None
        if status == "raise":
            self._stop_child()
            raise value
        self._adopt(value)
        # the child says whether the rows fit its vocabulary (the header's count may differ)
        self._shared = (np.frombuffer(shared, np.float32).reshape(shared_shape) if value["shared_rows"]
                        else np.empty((0, self.n_vocab), np.float32))
        _log.info("%s over RPC workers: %s", Path(path).name, self.placement.describe())

    def _adopt(self, facts: dict) -> None:
        self.info: ModelInfo = facts["info"]
        self.n_vocab, self.n_ctx, self.n_seq = facts["n_vocab"], facts["n_ctx"], facts["n_seq"]
        self.n_batch, self.kv_cache_type = facts["n_batch"], facts["kv_cache_type"]
        self.threads, self.placement = facts["threads"], facts["placement"]
        self._pieces: list[bytes] = facts["pieces"]
        self._control = frozenset(facts["control"])
        self._texts: dict[int, str] = dict(facts["texts"])
        self._ledger = KvLedger(self.n_seq)

    # -- the pipes -------------------------------------------------------------------

    def _receive(self, conn, timeout: float, doing: str):
        """The child's next answer; WorkerLostError when it died or did not answer in time."""
        ready = wait_ready([conn, self._proc.sentinel], timeout)
        if conn in ready:
            try:
                return conn.recv()
            except (EOFError, OSError):
                pass  # the child closed the pipe mid-answer: it is gone
        elif not ready:
            self._give_up(f"gave no answer within {timeout:g} s {doing} and was stopped")
        self._give_up(self._exit_cause(doing))

    def _exit_cause(self, doing: str) -> str:
        self._proc.join(1.0)
        code = self._proc.exitcode
        if code is None:
            return f"closed its pipe {doing}"
        if code < 0:
            return f"was killed by signal {-code} {doing}"
        return f"ended with exit code {code} {doing}"

    def _give_up(self, cause: str):
        """Stop the child (once), work out which worker is gone, and raise WorkerLostError."""
        with self._state_lock:
            if self.lost is None:
                self._stop_child(kill=True)
                gone = [ep for ep in self.endpoints if not accepts(ep)]
                self.lost = lost_message(cause, self.endpoints, gone)  # the server logs it where it fails
        raise WorkerLostError(self.lost)

    def _call(self, op: str, *args, side: bool = False):
        if side:
            return self._side_call(op, args)
        with self._main_lock:
            return self._call_locked(self._main, op, args)

    def _side_call(self, op: str, args, what: str = ""):
        """A tokenize or token_text call, bounded by its own timeout: past it, this call
        fails (SideCallTimeoutError) and the pipe stays in step by dropping its late answer
        before the next call; only a child that died is given up on."""
        timeout = TOKENIZE_TIMEOUT_S if self.call_timeout is None else min(self.call_timeout, TOKENIZE_TIMEOUT_S)
        what = what or op
        with self._side_lock:
            if self.lost is not None:
                raise WorkerLostError(self.lost)
            while self._side_owed:  # a late answer of a call given up on comes first
                self._side_answer(timeout, f"an earlier {op} that took over {timeout:g} s", late=True)
                self._side_owed -= 1
            try:
                self._side.send((op, args))
            except (OSError, ValueError):  # a broken pipe: the child is gone
                self._give_up(self._exit_cause(f"during {op}"))
            status, value = self._side_answer(timeout, what)
        if status == "raise":
            raise value
        return value

    def _side_answer(self, timeout: float, what: str, late: bool = False):
        ready = wait_ready([self._side, self._proc.sentinel], timeout)
        if self._side in ready:
            try:
                return self._side.recv()
            except (EOFError, OSError):
                pass  # the child closed the pipe mid-answer: it is gone
        elif not ready:
            if not late:
                self._side_owed += 1
            message = (f"the model's process is still busy with {what}; retry the request" if late
                       else f"{what} took over {timeout:g} s in the model's process; the model stays loaded")
            _log.warning("%s: %s (tokenizing runs in the model's child process; its RPC workers are not involved)",
                         Path(self.info.path).name, message)
            raise SideCallTimeoutError(message)
        self._give_up(self._exit_cause(f"during {what}"))

    def _call_locked(self, conn, op: str, args):
        if self.lost is not None:
            raise WorkerLostError(self.lost)
        try:
            conn.send((op, args))
        except (OSError, ValueError):  # a broken pipe, or closed here by another thread's give-up
            self._give_up(self._exit_cause(f"during {op}"))
        status, value = self._receive(conn, self.call_timeout, f"during {op}")
        if status == "raise":
            raise value
        return value

    def _stop_child(self, kill: bool = False) -> None:
        if kill and self._proc.is_alive():
            self._proc.kill()
        self._proc.join(CLOSE_WAIT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    # -- tokens (the vocabulary was copied at load) -------------------------------------

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > TOKENIZE_MAX_BYTES:
            raise BadRequestError(f"a text of {size:,} bytes is too long to tokenize over RPC"
                                  f" (at most {TOKENIZE_MAX_BYTES:,} bytes, TOKENIZE_MAX_BYTES)")
        return self._side_call("tokenize", (text, add_special, parse_special), f"tokenizing a text of {size:,} bytes")

    def _check_token(self, token: int) -> int:
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} outside the vocabulary 0..{self.n_vocab - 1}")
        return token

    def token_bytes(self, token: int) -> bytes:
        return self._pieces[self._check_token(token)]

    def is_control(self, token: int) -> bool:
        return self._check_token(token) in self._control

    def token_text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._call("token_text", self._check_token(token), side=True)
        return text

    # -- forward pass ----------------------------------------------------------------

    def decode(self, batch: Sequence[BatchEntry]) -> list[np.ndarray]:
        check_batch(batch, self.n_seq, self.n_ctx, self.n_batch)  # a bad batch is the caller's, not the child's
        wire = [(e.seq, [int(t) for t in e.tokens], e.pos, e.n_logits) for e in batch]
        n_out = sum(e.n_logits for e in batch)
        with self._main_lock:
            # raises DecodeInterrupted, DecodeError as in-process
            if self._call_locked(self._main, "decode", wire) == "shared":  # the rows are in the shared block
                out, r = [], 0
                for e in batch:
                    out.append(self._shared[r : r + e.n_logits])
                    r += e.n_logits
                self._ledger.fed(batch)
                return out
            if len(self._rows) < n_out or self._rows.shape[1] != self.n_vocab:
                self._rows = np.empty((max(n_out, 2 * len(self._rows), self.n_seq), self.n_vocab), np.float32)
            out, r = [], 0
            for e in batch:
                rows = self._rows[r : r + e.n_logits]
                if e.n_logits:
                    self._receive_rows(rows)
                out.append(rows)
                r += e.n_logits
        self._ledger.fed(batch)
        return out

    def _receive_rows(self, rows: np.ndarray) -> None:
        if not wait_ready([self._main, self._proc.sentinel], self.call_timeout):
            self._give_up(f"gave no answer within {self.call_timeout:g} s while sending logits and was stopped")
        try:
            n = self._main.recv_bytes_into(memoryview(rows).cast("B"))
        except (EOFError, OSError):
            self._give_up(self._exit_cause("while sending logits"))
        except mp.BufferTooShort:
            n = -1
        if n != rows.nbytes:  # the pipe is out of step with the calls: only a new child can be trusted
            self._give_up(f"sent logits of another size than the {rows.nbytes} bytes asked for")

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        return self._call("embed", [int(t) for t in tokens])

    def interrupt(self) -> None:
        ctypes.memmove(self._flag, b"x", 1)

    def clear_interrupt(self) -> None:
        ctypes.memmove(self._flag, b"\0", 1)

    # -- KV cache (the ledger mirrors the child's) ------------------------------------------

    def kv_trim(self, seq: int, n_keep: int) -> None:
        self._kv_call("kv_trim", seq, n_keep)
        self._ledger.trimmed(seq, n_keep)

    def kv_copy(self, src: int, dst: int, n: int) -> None:
        self._kv_call("kv_copy", src, dst, n)
        self._ledger.copied(src, dst, n)

    def kv_clear(self, seq: int) -> None:
        self._kv_call("kv_clear", seq)
        self._ledger.cleared(seq)

    def _kv_call(self, op: str, seq_or_src: int, *rest) -> None:
        try:
            self._call(op, seq_or_src, *rest)
        except WorkerLostError:
            raise
        except Exception:  # e.g. CacheNotTrimmableError: the child's ledger says what the cache holds now
            touched = rest[0] if op == "kv_copy" else seq_or_src
            held = self._call("kv_tokens", touched)
            self._ledger.cleared(touched)
            self._ledger.fed([BatchEntry(touched, held, 0, 0)])
            raise

    def kv_tokens(self, seq: int) -> list[int]:
        return self._ledger.tokens(seq)

    def kv_state_bytes(self, seq: int) -> int:
        return self._call("kv_state_bytes", seq)

    def close(self) -> None:
        if getattr(self, "_proc", None) is None:
            return
        with self._main_lock, self._side_lock:
            answered = False
            if self.lost is None and self._proc.is_alive():
                try:  # the child frees the model (on the workers too) and exits
                    self._main.send(("close", ()))
                except (OSError, ValueError):
                    pass  # it is gone already: nothing to free
                # no verdict on a child that dies while closing (its worker may be gone): it ends either way
                answered = bool(wait_ready([self._main, self._proc.sentinel], CLOSE_WAIT_S))
            self._stop_child(kill=not answered)
            for conn in (self._main, self._side):
                conn.close()
            self._proc.close()
            self._proc = None

    def __del__(self) -> None:  # a forgotten close must not leave the child (and its model) behind
        try:
            self.close()
        except Exception:  # at interpreter exit multiprocessing may be half gone: the daemon child ends anyway
            return

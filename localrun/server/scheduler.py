"""Continuous batching: one thread per loaded model drives `Engine.step` over every
active request.

Requests wait in a bounded queue; between two steps the scheduler admits as many as
there are free slots (the engine gives each the slot whose KV shares the longest prefix
with its prompt), drops the ones whose client went away, and then runs ONE backend
decode for all of them: decoding requests contribute their next token, new ones a chunk
of their prompt. So a chat and an editor's autocomplete progress together, and a request
that arrives mid-answer joins at the next step instead of waiting for the answer to end.

Events travel to the asyncio side through `loop.call_soon_threadsafe`; the HTTP
handler reads them from an asyncio.Queue. A cancelled request frees its slot at the
next step boundary: a step is one decode (a prefill chunk is bounded by `n_batch`).

A step fails as a whole only when the backend's decode fails (every job shared it);
one job's own work (its grammar, sampler, stop strings, n_indent) failing ends that job
alone, with an error naming what failed (Engine._fail, Scheduler._deliver).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..engine import Engine, Generation, GenerationFailed
from ..errors import LocalrunError
from ..request import GenerationRequest
from .indent import IndentLimit


log = logging.getLogger("localrun.server")

# How long stop() waits for the scheduler thread. A step is bounded (prompt chunks are
# sized to ~0.15 s, a decode in flight is interrupted), so the thread normally ends at
# once; this bounds shutdown even when it does not.
STOP_WAIT_S = 3.0


class QueueFullError(LocalrunError):
    http_status = 503


END = object()  # the last item a job's queue receives


@dataclass
class Job:
    tokens: list[int]
    request: GenerationRequest  # what Engine.start takes, already prepared for this model
    loop: asyncio.AbstractEventLoop
    t_max_predict_ms: float | None = None
    indent: IndentLimit | None = None  # llama-server's n_indent
    id: int = field(default_factory=itertools.count().__next__)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    gen: Generation | None = None
    has_newline: bool = False  # for t_max_predict_ms
    _t_first: float | None = None

    def post(self, item) -> None:
        """Hand an Event, an exception or END to the waiting handler (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Stats:
    """Counters for /metrics (llama-server's names) and /slots."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    decode_calls: int = 0
    requests_done: int = 0


class StepBudget:
    """How many tokens one step may carry.

    A step is the unit of everything the scheduler does between decodes: a new request
    joins, every decoding stream gets its next token. While streams are decoding, a long
    prompt read in n_batch chunks would stall them for seconds on a CPU (a 256-token
    chunk of a small model takes ~1 s on one busy core), so prompt chunks are sized from
    the measured throughput to keep a step near `target_s`; on a GPU the rate is high and
    n_batch is the cap. With no stream waiting, a prompt is read in full n_batch chunks
    (fastest), and a hang-up interrupts the decode itself where the backend can."""

    def __init__(self, n_batch: int, target_s: float = 0.15, start: int = 32) -> None:
        self.n_batch, self.target_s = n_batch, target_s
        self.rate: float | None = None  # tokens per second, smoothed
        self.start = min(start, n_batch)

    def tokens(self, decoding: bool, can_interrupt: bool) -> int:
        """Full n_batch chunks (fastest prompt reading) when no stream waits on this step
        and a cancel can interrupt it; else chunks that keep the step near target_s."""
        if not decoding and can_interrupt:
            return self.n_batch
        if self.rate is None:
            return self.start
        return max(MIN_CHUNK, min(self.n_batch, int(self.rate * self.target_s)))

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens < MIN_CHUNK or seconds <= 0:  # decode-only steps say little about prompt speed
            return
        rate = n_tokens / seconds
        self.rate = rate if self.rate is None else 0.7 * self.rate + 0.3 * rate


MIN_CHUNK = 16  # below this, per-step overhead outweighs the latency won


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int = 64, name: str = "") -> None:
        self.engine = engine
        self.budget = StepBudget(engine.backend.n_batch)
        self.max_queue = max_queue
        self.stats = Stats()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._calls: deque[tuple] = deque()  # work that must run on the engine's thread
        self._cv = threading.Condition()
        # ids of the jobs in the step being decoded now: a hang-up interrupts that decode
        # only if it holds the job, never another client's step
        self._in_flight: set[int] = set()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"localrun-scheduler {name}", daemon=True)
        self._thread.start()

    # -- the asyncio side ----------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopped:
                raise QueueFullError("the model is unloading; retry the request")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"the server is busy: {self.max_queue} requests are already queued; retry later")
            self._waiting.append(job)
            self._cv.notify()

    async def call(self, fn):
        """Run fn() on the scheduler thread between two steps (the backends are not
        thread-safe) and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cv:
            if self._stopped:
                raise QueueFullError("the model is unloading; retry the request")
            self._calls.append((fn, future, loop))
            self._cv.notify()
        return await future

    def cancel(self, job: Job) -> None:
        job.cancel()
        with self._cv:
            # stop the decode it is part of now, not after its (maybe long) chunk; under
            # the lock, so the step's end (which withdraws a late interrupt) cannot pass
            if job.id in self._in_flight:
                self.engine.backend.interrupt()
            self._cv.notify()

    @property
    def busy(self) -> bool:
        with self._cv:
            return bool(self._waiting or self._active)

    def counts(self) -> tuple[int, int]:
        """(processing, deferred) request counts."""
        with self._cv:
            return len(self._active), len(self._waiting)

    def slots(self) -> list[dict]:
        with self._cv:
            by_seq = {j.gen.seq: j for j in self._active if j.gen is not None}
        out = []
        for seq in range(self.engine.backend.n_seq):
            job = by_seq.get(seq)
            out.append(
                {
                    "id": seq,
                    "n_ctx": self.engine.n_ctx,
                    "is_processing": job is not None,
                    "id_task": job.id if job else -1,
                    "n_cached": len(self.engine.backend.kv_tokens(seq)),
                    "n_decoded": len(job.gen.output) if job else 0,
                }
            )
        return out

    def request_stop(self) -> None:
        """Begin finishing without waiting: interrupt the decode in flight; the thread
        then fails whatever waits or runs (their streams end) and exits."""
        with self._cv:
            self._stopped = True
            if self._in_flight:
                self.engine.backend.interrupt()
            self._cv.notify()

    def stop(self, wait_s: float = STOP_WAIT_S) -> bool:
        """request_stop(), then wait up to wait_s for the thread. True once it has exited;
        only then may the caller free the engine (a decode may still run on it otherwise)."""
        self.request_stop()
        self._thread.join(timeout=wait_s)
        return self.exited

    @property
    def exited(self) -> bool:
        return not self._thread.is_alive()

    # -- the scheduler thread ------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not self._waiting and not self._active and not self._calls:
                    self._cv.wait()
                if self._stopped:
                    break
                calls = list(self._calls)
                self._calls.clear()
            for fn, future, loop in calls:
                _settle(future, loop, fn)
            with self._cv:
                self._drop_cancelled()
                self._admit()
                active = list(self._active)
            if not active:
                continue
            with self._cv:
                self._in_flight = {job.id for job in active}
            try:
                self._step(active)
            except Exception as exc:  # a backend failure ends these requests, not the server
                if isinstance(exc, LocalrunError):  # foreseeable (a lost RPC worker): its line says it all
                    log.error("generation failed on %s: %s", self._thread.name, exc)
                else:
                    log.exception("generation failed on %s", self._thread.name)
                reason = str(exc) if isinstance(exc, LocalrunError) else "internal error, see the server log"
                with self._cv:
                    for job in active:
                        failure = LocalrunError(f"generation failed: {reason}")
                        if isinstance(exc, LocalrunError):  # a lost RPC worker stays a 503, not a 400
                            failure.http_status = exc.http_status
                        self._end(job, failure)
            finally:
                with self._cv:
                    self._in_flight = set()
                    # an interrupt that arrived after the decode ended was meant for it
                    self.engine.backend.clear_interrupt()
        with self._cv:
            for job in list(self._waiting) + self._active:
                self._end(job, QueueFullError("the model was unloaded; retry the request"))
            self._waiting.clear()
            for _, future, loop in self._calls:
                _settle(future, loop, _unloaded)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.cancelled.is_set()]:
            self._waiting.remove(job)
            job.post(END)
        for job in [j for j in self._active if j.cancelled.is_set()]:
            self._end(job, END)

    def _admit(self) -> None:
        while self._waiting and self.engine.free_slots:
            job = self._waiting.popleft()
            try:
                job.gen = self.engine.start(job.tokens, job.request)
            except Exception as exc:  # refuse this request; the others go on
                if not isinstance(exc, LocalrunError):
                    log.exception("could not start a generation")
                    exc = LocalrunError("could not start the generation (internal error, see the server log)")
                job.post(exc)
                job.post(END)
                continue
            self._active.append(job)

    def _step(self, active: list[Job]) -> None:
        gens = [j.gen for j in active]
        before = sum(g.n_cached for g in gens)
        t0 = time.perf_counter()
        decoding = any(len(g.pending) == 1 for g in gens)
        events = self.engine.step(gens, self.budget.tokens(decoding, self.engine.backend.can_interrupt))
        now = time.perf_counter()
        self.budget.observe(sum(g.n_cached for g in gens) - before, now - t0)
        self.stats.decode_calls += 1
        with self._cv:
            for job in active:
                if job not in self._active:
                    continue
                if job.gen.error is not None:  # its own work failed in the engine's step: it alone ends
                    log.warning("request %d ended: %s", job.id, job.gen.error)
                    self._end(job, job.gen.error)
                    continue
                ev = events.get(job.gen.seq)
                if ev is None:
                    continue
                try:
                    self._deliver(job, ev, now)
                except Exception as exc:  # n_indent, a time budget, the last flush: this job alone
                    log.error("request %d failed after its step", job.id, exc_info=exc)
                    self._end(job, GenerationFailed(
                        "generation failed: internal error while finishing this request (see the server log)"))

    def _deliver(self, job: Job, ev, now: float) -> None:
        """Hand one job its step's event, and end it when it is done (lock held)."""
        if job._t_first is None:
            job._t_first = now
            self.stats.prompt_tokens += job.gen.timings.prompt_tokens - job.gen.timings.cached_tokens
            self.stats.prompt_seconds += job.gen.timings.prefill_ms / 1000
        cut = job.indent.cut(ev.text) if job.indent is not None else None
        if cut is not None:
            ev.text = ev.text[:cut]
        job.post(ev)
        job.has_newline = job.has_newline or "\n" in ev.text
        if cut is not None and not job.gen.done:
            last = self.engine.finish(job.gen, "length")  # llama-server's stop_type "limit"
            last.text = ""  # what the stop matcher still held comes after the cut
            job.post(last)
        elif self._out_of_time(job, now):
            job.post(self.engine.finish(job.gen, "length"))
        if job.gen.done:
            t = job.gen.timings
            self.stats.predicted_tokens += t.generated_tokens
            self.stats.predicted_seconds += t.decode_ms / 1000
            self.stats.requests_done += 1
            self._end(job, END)

    def _out_of_time(self, job: Job, now: float) -> bool:
        """llama-server's t_max_predict_ms, an editor's time budget for a completion: it
        applies once the answer has a newline (a one-line completion always finishes)."""
        limit = job.t_max_predict_ms
        if not limit or limit <= 0 or job.gen.done or job._t_first is None:
            return False
        return job.has_newline and (now - job._t_first) * 1000 >= limit

    def _end(self, job: Job, item) -> None:
        """Release the job's slot and close its stream (call with the lock held)."""
        if job in self._active:
            self._active.remove(job)
        if job.gen is not None:
            self.engine.release(job.gen)
        if item is not END:
            job.post(item)
        job.post(END)


def _unloaded():
    raise QueueFullError("the model was unloaded; retry the request")


def _settle(future: asyncio.Future, loop: asyncio.AbstractEventLoop, fn) -> None:
    """Run fn here and hand its result (or error) to the future on its own loop."""
    try:
        result, error = fn(), None
    except Exception as exc:  # delivered to the caller, who maps it to a response
        result, error = None, exc

    def deliver() -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # the loop is gone
        pass

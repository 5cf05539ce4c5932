"""The scheduler's interrupts: a hang-up stops only a decode that holds the hung-up job,
and an interrupt that arrives after its decode ended never aborts the next one (another
client's step). Run on the scripted backend, whose decode can be held open."""

from __future__ import annotations

import asyncio
import threading

from fakes import ScriptedBackend

from localrun.engine import Engine
from localrun.request import GenerationRequest
from localrun.sampling import SamplingParams
from localrun.server.scheduler import Job, Scheduler


class GatedBackend(ScriptedBackend):
    """Every decode waits at a gate the test opens; interrupts are recorded."""

    def __init__(self) -> None:
        super().__init__(script=lambda hist: ord("a"), n_ctx=256, n_seq=2, n_batch=64)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.flag = False
        self.interrupts = 0

    def decode(self, batch):
        self.entered.set()
        assert self.gate.wait(20), "the test never opened the gate"
        return super().decode(batch)

    def interrupt(self) -> None:
        self.interrupts += 1
        self.flag = True

    def clear_interrupt(self) -> None:
        self.flag = False


def make_job(loop, max_tokens: int = 1000) -> Job:
    req = GenerationRequest.of(sampling=SamplingParams(temperature=0), max_tokens=max_tokens, lookup=False)
    return Job([1, 2, 3], req, loop)


def test_a_hang_up_interrupts_only_the_decode_holding_its_job():
    backend = GatedBackend()
    sched = Scheduler(Engine(backend), max_queue=4)
    loop = asyncio.new_event_loop()
    try:
        running = make_job(loop)
        sched.submit(running)
        assert backend.entered.wait(10)
        queued = make_job(loop)
        sched.submit(queued)
        sched.cancel(queued)  # never in the decode: must not stop the running client's step
        assert backend.interrupts == 0 and not backend.flag
        sched.cancel(running)  # in the decode now: stop it
        assert backend.interrupts == 1 and backend.flag
        backend.gate.set()
    finally:
        assert sched.stop()
        loop.close()
    # the step's end withdrew the flag, so it cannot abort a later decode
    assert not backend.flag


def test_stop_interrupts_a_step_in_flight_and_reports_the_thread_exited():
    backend = GatedBackend()
    sched = Scheduler(Engine(backend), max_queue=4)
    loop = asyncio.new_event_loop()
    try:
        sched.submit(make_job(loop))
        assert backend.entered.wait(10)
        sched.request_stop()
        assert backend.interrupts == 1
        assert not sched.stop(wait_s=0.2)  # the decode is still held open: not exited
        backend.gate.set()
        assert sched.stop()
        assert sched.exited
    finally:
        backend.gate.set()
        loop.close()

"""The scheduler's interrupts: a hang-up stops only a decode that holds the hung-up job,
and an interrupt that arrives after its decode ended never aborts the next one (another
client's step). One job's own failure (its grammar's parser, its sampler) ends that job
alone while the others finish with the text they have alone; a failed decode, which every
job of the step shares, fails them all. Run on the scripted backend."""

from __future__ import annotations

import asyncio
import threading

from fakes import ScriptedBackend

from localrun.engine import Engine
from localrun.errors import DecodeError, LocalrunError
from localrun.grammar.core import Grammar
from localrun.request import GenerationRequest
from localrun.sampling import SamplingParams
from localrun.server.scheduler import END, Job, Scheduler


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


# -- one job's failure stays in that job ----------------------------------------------

# An ambiguous Lark grammar (issue 49): it compiles at once and its mask allows every
# "a", but llguidance's parser exceeds its 2,000 items per row after ~44 of them and
# consume_token fails AFTER the mask allowed the token.
AMBIGUOUS = "%llguidance {}\nstart: s0\n" + "\n".join(f's{i}: s{i} s{i + 1} | "a"' for i in range(200)) + '\ns200: "a"'


def _script(hist: list[int]) -> int:
    """A prompt starting with "A" gets "a" forever (the grammar's attacker); any other
    prompt walks the alphabet from its length, so each victim's text is its own."""
    return ord("a") if hist[0] == ord("A") else ord("a") + len(hist) % 26


def _request(max_tokens: int, grammar=None) -> GenerationRequest:
    return GenerationRequest.of(sampling=SamplingParams(temperature=0), max_tokens=max_tokens, lookup=False,
                                grammar=grammar, ignore_eos=True)


def _alone(prompt: bytes, max_tokens: int) -> str:
    """The text a prompt gets with the model to itself."""
    eng = Engine(ScriptedBackend(script=_script, n_ctx=256, n_seq=1, n_batch=64))
    return eng.complete(list(prompt), _request(max_tokens)).text


def _run_jobs(sched: Scheduler, loop, jobs: list[Job]) -> list[tuple[str, BaseException | None]]:
    """Submit the jobs together and read each to its END: (text, the error it ended with)."""

    async def read(job: Job):
        parts, error = [], None
        while (item := await job.queue.get()) is not END:
            if isinstance(item, BaseException):
                error = item
            else:
                parts.append(item.text)
        return "".join(parts), error

    async def main():
        for job in jobs:
            sched.submit(job)
        return await asyncio.wait_for(asyncio.gather(*(read(j) for j in jobs)), 30)

    return loop.run_until_complete(main())


def test_a_grammar_that_trips_its_parser_ends_only_its_own_job():
    sched = Scheduler(Engine(ScriptedBackend(script=_script, n_ctx=256, n_seq=3, n_batch=64)), max_queue=4)
    loop = asyncio.new_event_loop()
    try:
        victims = [b"xyz", b"pqrst"]
        jobs = [Job(list(v), _request(120), loop) for v in victims]
        jobs.insert(1, Job(list(b"Attack"), _request(120, Grammar.from_lark(AMBIGUOUS)), loop))
        results = _run_jobs(sched, loop, jobs)
    finally:
        assert sched.stop()
        loop.close()
    text, error = results[1]
    assert isinstance(error, LocalrunError) and error.http_status == 400, error
    assert "the grammar's parser hit its limit" in str(error) and "max is 2000" in str(error), error
    assert "\n" not in str(error)
    assert 0 < len(text) < 120 and set(text) == {"a"}  # it streamed until its parser gave up
    for victim, (text, error) in zip(victims, [results[0], results[2]]):
        assert error is None, error
        assert text == _alone(victim, 120)


def test_a_sampler_that_raises_ends_only_its_own_job(caplog):
    """A bug in one generation's sampling: a 500 naming an internal error for that client
    (the traceback goes to the log), and the step's other jobs finish unchanged."""
    engine = Engine(ScriptedBackend(script=_script, n_ctx=256, n_seq=3, n_batch=64))
    start = engine.start

    def start_with_a_broken_sampler(tokens, request):
        gen = start(tokens, request)
        if tokens[0] == ord("A"):
            sample, calls = gen.sampler.sample, []

            def broken(row, history):
                calls.append(1)
                if len(calls) > 5:
                    raise RuntimeError("boom in the sampler")
                return sample(row, history)

            gen.sampler.sample = broken
        return gen

    engine.start = start_with_a_broken_sampler
    sched = Scheduler(engine, max_queue=4)
    loop = asyncio.new_event_loop()
    try:
        victims = [b"xyz", b"pqrst"]
        jobs = [Job(list(v), _request(80), loop) for v in victims] + [Job(list(b"Attack"), _request(80), loop)]
        results = _run_jobs(sched, loop, jobs)
    finally:
        assert sched.stop()
        loop.close()
    text, error = results[2]
    assert text == "aaaaa"
    assert isinstance(error, LocalrunError) and error.http_status == 500
    assert str(error) == "generation failed: internal error in this request's step (see the server log)"
    assert "boom in the sampler" in caplog.text  # the log has the cause; the client does not
    for victim, (text, error) in zip(victims, results[:2]):
        assert error is None, error
        assert text == _alone(victim, 80)
    assert engine.free_slots == 3  # every slot came back


def test_a_decode_failure_still_fails_every_job_of_the_step():
    """The backend's decode is shared: when it fails, each job of the step gets the error."""

    class Failing(ScriptedBackend):
        def decode(self, batch):
            if any(e.pos > 8 for e in batch):
                raise DecodeError("llama_decode failed (-1)")
            return super().decode(batch)

    sched = Scheduler(Engine(Failing(script=_script, n_ctx=256, n_seq=2, n_batch=64)), max_queue=4)
    loop = asyncio.new_event_loop()
    try:
        results = _run_jobs(sched, loop, [Job(list(b"xyz"), _request(40), loop), Job(list(b"pq"), _request(40), loop)])
    finally:
        assert sched.stop()
        loop.close()
    for _, error in results:
        assert isinstance(error, LocalrunError) and "llama_decode failed" in str(error)

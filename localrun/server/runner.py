"""Between a dialect and the scheduler: queue a job after every check that can refuse
it (so a refusal is a 400 before any byte is streamed), then read its events."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.requests import Request

from ..engine import Event, Timings
from ..request import GenerationRequest, prepare
from .http import until_done_or_disconnect
from .indent import IndentLimit
from .models import Loaded
from .scheduler import END, Job


async def submit(model: Loaded, tokens: list[int], request: GenerationRequest) -> Job:
    """Queue a generation after every check that can refuse it. The request is prepared
    for the model (text logit bias tokenized, ids checked against the vocabulary, DRY
    breakers and the grammar's tokenizer resolved) and the prompt checked in a worker
    thread: that work grows with the request and the vocabulary, and neither the event
    loop nor the model's scheduler thread may wait for it."""

    def ready() -> GenerationRequest:
        model.engine.check_prompt(tokens)
        return prepare(model.engine, request, tokens)

    request = await asyncio.to_thread(ready)
    indent = IndentLimit(request.n_indent) if request.n_indent else None
    job = Job(tokens, request, asyncio.get_running_loop(), request.t_max_predict_ms, indent)
    model.scheduler.submit(job)
    return job


async def events(model: Loaded, job: Job) -> AsyncIterator[Event]:
    """The job's events as they come; raises what the scheduler posted on failure."""
    try:
        while True:
            item = await job.queue.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            model.last_used = time.monotonic()
            yield item
    finally:
        model.scheduler.cancel(job)  # a no-op for a finished job; frees a slot otherwise


@dataclass
class Result:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    timings: Timings = field(default_factory=Timings)
    top_probs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_probs: list[float] = field(default_factory=list)
    tool_calls: list = field(default_factory=list)  # ToolCallDelta, in order (localrun.tools.collect_calls joins them)
    reasoning: str = ""  # the thinking, apart from the answer's text
    reasoning_tokens: int = 0


def reasoning_tokens(ev: Event) -> int:
    """The tokens of `ev` that were thinking: all of them when it carries reasoning and no
    answer text (an event that crosses from thinking to the answer counts as answer: the
    usage's reasoning_tokens may be a token short, never long)."""
    return len(ev.tokens) if ev.reasoning and not ev.text else 0


async def collect(request: Request, model: Loaded, job: Job) -> Result:
    """Run the job to its end; a client that hangs up cancels it."""

    async def gather() -> Result:
        out = Result()
        parts, thoughts = [], []
        async for ev in events(model, job):
            parts.append(ev.text)
            thoughts.append(ev.reasoning)
            out.reasoning_tokens += reasoning_tokens(ev)
            out.tokens.extend(ev.tokens)
            out.top_probs.extend(ev.top_probs or [])
            out.token_probs.extend(ev.token_probs or [])
            out.tool_calls.extend(ev.tool_calls or ())
            if ev.finish_reason:
                out.finish_reason = ev.finish_reason
                out.timings = ev.timings or out.timings
        out.text = "".join(parts)
        out.reasoning = "".join(thoughts)
        return out

    return await until_done_or_disconnect(request, gather(), lambda: model.scheduler.cancel(job))


def logprob(p: float) -> float:
    return math.log(p) if p > 0 else -9999.0


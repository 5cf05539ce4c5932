"""The Anthropic dialect's replies: a whole Message, or the Messages stream's SSE events,
rendered from the engine's events (thinking, text pieces and tool-call deltas).

    message_start                         the message, empty content, usage.input_tokens
    content_block_start  {index, block}   a thinking block {thinking: "", signature: ""}, a text
                                          block, or a tool_use block {id, name, input: {}}
    content_block_delta  {index, delta}   thinking_delta {thinking} | signature_delta {signature}
                                          (once, just before a thinking block stops) |
                                          text_delta {text} | input_json_delta {partial_json}
    content_block_stop   {index}
    message_delta        {delta: {stop_reason, stop_sequence}, usage}
    message_stop
    ping                                  while nothing else is sent (a long prompt being read)
    error                                 a failure after the stream began, Anthropic's error body

Each is `event: NAME\\ndata: JSON\\n\\n`. A tool_use block's partial_json fragments join to
its input's JSON text. Thinking comes first, text only before calls (the call grammar
ends the answer with its calls); a block of each kind opens when its kind of output
starts, so a model that thinks again between calls gets a thinking block there.

A thinking block's `signature` is opaque to clients, which hand it back with the block;
here it is a digest of the thinking text (nothing to verify: the history's thinking
only reaches the template), so a whole answer and a stream carry the same one. With
`thinking.display: "omitted"` a block's thinking comes back empty (no thinking_delta is
streamed) and its signature carries the text instead (CARRIED + base64url), as
Anthropic's signature carries omitted thinking: handed back, the block gives the
template its thinking again (anthropic_api reads it with `carried_thinking`).

Usage follows Anthropic: `input_tokens` counts the prompt tokens read afresh, and
`cache_read_input_tokens` those a previous request left in the KV cache. Which those are
is known only once the prompt has been placed in a slot, so message_start reports the
whole prompt as input_tokens, and message_delta the final split (the SDKs take both
from message_delta)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import uuid
from collections import deque
from typing import AsyncIterator

from ..errors import BadRequestError, LocalrunError
from ..tools import collect_calls
from .http import ANTHROPIC_ERROR_TYPES
from .runner import Result, events

log = logging.getLogger("localrun.server")

PING_S = 5.0  # seconds of silence before a ping (an agent's 12k-token prompt reads for a minute on a CPU)
# Output tokens searched for the stop sequence that ended an answer: it ends in the last
# token, and a stop string is at most MAX_STOP_CHARS = 256 characters, each at most 4 tokens
# of single bytes.
STOP_WINDOW_TOKENS = 1100
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def prompt_too_long(n: int, n_ctx: int) -> BadRequestError:
    """Anthropic's wording, which clients (Claude Code) match to compact the history: the
    largest prompt that fits leaves one position to generate in."""
    return BadRequestError(f"prompt is too long: {n} tokens > {n_ctx - 1} maximum")


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_id(call_id: str) -> str:
    """The engine's call id ("call_" + hex) under Anthropic's prefix."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(timings, prompt_tokens: int | None = None) -> dict:
    cached = timings.cached_tokens if timings else 0
    prompt = timings.prompt_tokens if timings and timings.prompt_tokens else prompt_tokens or 0
    return {
        "input_tokens": prompt - cached,
        "output_tokens": timings.generated_tokens if timings else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def stop_fields(engine, finish_reason: str | None, tokens, stops) -> tuple[str, str | None]:
    """stop_reason and stop_sequence. The engine cuts a matched stop string from the text
    and says only "stop", so the string is found in the output tokens' text: the earliest
    occurrence of any stop string (ties to the smaller string, as the engine's
    StopMatcher picks) is the one that hit, since any earlier one would have ended the
    answer sooner."""
    if finish_reason != "stop":
        return STOP_REASONS.get(finish_reason or "", "end_turn"), None
    if stops:
        tail = engine.detokenize(list(tokens)[-STOP_WINDOW_TOKENS:])
        found = [(i, s) for s in stops if (i := tail.find(s)) >= 0]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def _tool_block(call) -> dict | None:
    """A whole call as a tool_use block; None for a call cut off midway (max_tokens),
    whose arguments are no JSON object to run."""
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": arguments}


CARRIED = "localrun-thinking."  # a signature that carries an omitted block's text


def signature(thinking: str, omitted: bool = False) -> str:
    """A thinking block's signature (see the module docstring)."""
    data = thinking.encode("utf-8", "surrogatepass")
    if omitted:
        return CARRIED + base64.urlsafe_b64encode(data).decode("ascii")
    return hashlib.sha256(data).hexdigest()


def carried_thinking(sig: str) -> str | None:
    """The text an omitted block's signature carries; None for any other signature (a
    digest, another server's, or one damaged on the way)."""
    if not sig.startswith(CARRIED):
        return None
    try:
        return base64.urlsafe_b64decode(sig[len(CARRIED):].encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeError):  # binascii.Error is a ValueError
        return None


def thinking_block(thinking: str, omitted: bool = False) -> dict:
    return {"type": "thinking", "thinking": "" if omitted else thinking, "signature": signature(thinking, omitted)}


def message_body(engine, res: Result, model: str, stops, omit_thinking: bool = False) -> dict:
    """A non-streamed answer: a thinking block, a text block (each left out when empty),
    then one tool_use block per call."""
    content = [thinking_block(res.reasoning, omit_thinking)] if res.reasoning else []
    content += [{"type": "text", "text": res.text}] if res.text else []
    content += [b for b in map(_tool_block, collect_calls(res.tool_calls)) if b is not None]
    stop_reason, stop_sequence = stop_fields(engine, res.finish_reason, res.tokens, stops)
    return {
        "id": new_message_id(), "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage(res.timings),
    }


def sse(name: str, obj: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def error_event(exc: BaseException) -> bytes:
    if isinstance(exc, LocalrunError):
        kind, message = ANTHROPIC_ERROR_TYPES.get(exc.http_status, "api_error"), str(exc)
    else:  # a bug: its text may hold anything, so only the log gets it
        log.error("internal error in a /v1/messages stream", exc_info=exc)
        kind, message = "api_error", "internal error (see the server log)"
    return sse("error", {"type": "error", "error": {"type": kind, "message": message}})


async def _with_pings(source: AsyncIterator) -> AsyncIterator:
    """source's items, and None after every PING_S seconds without one. The pending read
    is a task that a timeout leaves running (cancelling it would end the source)."""
    it = source.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=PING_S)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # the generator is running inside it: let it unwind first
            pending.cancel()
            await asyncio.wait({pending})
        await it.aclose()  # events()'s own finally cancels the job


class _Blocks:
    """The content blocks of a streamed answer, opened and closed as text and calls come."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking  # display "omitted": the text goes in the signature
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.calls: dict[int, int] = {}  # the engine's call index -> block index
        self.thought: list[str] = []  # the open thinking block's text, for its signature

    def _start(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + [sse("content_block_start", start)]

    def _delta(self, index: int, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            sig = signature("".join(self.thought), self.omit_thinking)
            out.append(self._delta(self.index, {"type": "signature_delta", "signature": sig}))
            self.thought = []
        self.open = None
        return out + [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def thinking(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""}) if self.open != "thinking" else []
        self.thought.append(text)
        if self.omit_thinking:
            return out
        return out + [self._delta(self.index, {"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._start("text", {"type": "text", "text": ""}) if self.open != "text" else []
        return out + [self._delta(self.index, {"type": "text_delta", "text": text})]

    def call(self, d) -> list[bytes]:
        out = []
        if d.id is not None:
            out = self._start("tool_use", {"type": "tool_use", "id": tool_use_id(d.id), "name": d.name, "input": {}})
            self.calls[d.index] = self.index
        if d.arguments and d.index in self.calls:
            out.append(self._delta(self.calls[d.index], {"type": "input_json_delta", "partial_json": d.arguments}))
        return out


async def message_events(model, job, name: str, prompt_tokens: int, stops,
                         omit_thinking: bool = False) -> AsyncIterator[bytes]:
    """The SSE body of a streamed answer (see the module docstring)."""
    head = {"id": new_message_id(), "type": "message", "role": "assistant", "model": name, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
    yield sse("message_start", {"type": "message_start", "message": head})
    blocks = _Blocks(omit_thinking)
    tail: deque[int] = deque(maxlen=STOP_WINDOW_TOKENS)  # for stop_fields, bounded
    try:
        async for ev in _with_pings(events(model, job)):
            if ev is None:
                yield sse("ping", {"type": "ping"})
                continue
            tail.extend(ev.tokens)
            for chunk in blocks.thinking(ev.reasoning):
                yield chunk
            for chunk in blocks.text(ev.text):
                yield chunk
            for d in ev.tool_calls or ():
                for chunk in blocks.call(d):
                    yield chunk
            if ev.finish_reason:
                for chunk in blocks.close():
                    yield chunk
                stop_reason, stop_sequence = stop_fields(model.engine, ev.finish_reason, tail, stops)
                yield sse("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                            "usage": usage(ev.timings, prompt_tokens)})
                yield sse("message_stop", {"type": "message_stop"})
    except Exception as exc:  # the stream has begun: report in-band, in Anthropic's shape
        yield error_event(exc)

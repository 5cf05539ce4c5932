"""The OpenAI dialect: /v1/chat/completions (with tools), /v1/completions (with `suffix`
as fill-in-the-middle), /v1/models, /v1/embeddings. Streams are SSE ending in
`data: [DONE]`; errors use OpenAI's {"error": {...}} body. Every llama-server sampling
field is accepted too, as llama-server's own /v1 routes do; llama-server's tool calls
are these same routes.

Tool calls are the engine's events reshaped: streamed, `delta.tool_calls` entries (a
call's first names it, later ones carry argument fragments); whole, `message.tool_calls`
with arguments as JSON text and `content: null` when the answer is only calls;
`finish_reason: "tool_calls"` either way.

Reasoning ("thinking") is llama-server's `reasoning_content`, apart from `content`:
streamed as `delta.reasoning_content`, whole as `message.reasoning_content` (absent when
the model did not think), counted in `usage.completion_tokens_details.reasoning_tokens`.
The controls (reasoning_effort, chat_template_kwargs, reasoning_format,
thinking_budget_tokens / reasoning_budget) are read by reasoning.py. /v1/completions
takes a raw prompt and answers the raw text, thinking markup and all.
An assistant message's `reasoning_content` in the history reaches the template."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import numpy as np

from starlette.requests import Request
from starlette.routing import Route
from starlette.responses import JSONResponse

from ..errors import BadRequestError
from ..request import MAX_PROMPT_TOKENS, MAX_TOKENS_LIMIT, MAX_TOP_LOGPROBS, GenerationRequest
from ..tools import ToolsUnsupportedError, collect_calls, history_messages
from .fields import Body, generation_request, grammar_from, messages, sampling_params, tool_fields
from .reasoning import NO_REASONING, Reasoning, openai_chat
from .fim import fim_request, fim_tokens
from .http import sse, stream
from .runner import Result, collect, events, logprob, reasoning_tokens, submit
from .state import embed_inputs, endpoint, json_response, state


# the fields that constrain an answer (grammar_from's); a tool call brings its own grammar
CONSTRAINT_FIELDS = ("grammar", "json_schema", "response_format")


def build_request(b: Body, n_probs: int, chat: bool = False, reasoning: Reasoning = NO_REASONING) -> GenerationRequest:
    """The body's GenerationRequest (with its tools and reasoning controls for a chat,
    over `reasoning`, the route's defaults); compiles its grammar and the tools' schemas,
    so call it off the event loop."""
    if b.int("n", 1) != 1:
        raise BadRequestError("'n' must be 1: this server returns one choice per request")
    max_tokens = b.int("max_completion_tokens", lo=0, hi=MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = b.int("max_tokens", lo=0, hi=MAX_TOKENS_LIMIT)
    tools = tool_fields(b, CONSTRAINT_FIELDS) if chat else {}  # refused with a grammar before it compiles
    if chat:
        reasoning = openai_chat(b).over(reasoning)
    return generation_request(b, sampling_params(b, n_probs=n_probs), max_tokens, grammar_from(b), **tools,
                              **reasoning.request_fields())


def _usage(t, reasoning_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.generated_tokens,
        "total_tokens": t.prompt_tokens + t.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": t.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def _finish(reason: str | None) -> str | None:
    if reason is None:
        return None
    return reason if reason in ("length", "tool_calls") else "stop"


def _call_deltas(deltas) -> list[dict]:
    """OpenAI's streamed `delta.tool_calls`, one chunk's delta each: a call's first names
    it (index, id, type, function.name, empty arguments), the ones after carry fragments
    of its arguments' JSON text, which join to the whole."""
    out = []
    for d in deltas:
        if d.id is not None:
            head = {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            out.append({"tool_calls": [head]})
        if d.arguments:
            out.append({"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]})
    return out


def chat_delta(reasoning: str, text: str, with_logprobs: bool) -> dict | None:
    """One streamed event's `delta` (None when it has nothing to say): its thinking as
    `reasoning_content`, its answer text as `content`. An event's logprobs need a chunk
    even when the token wrote nothing (a marker)."""
    delta = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if text or (with_logprobs and not reasoning):
        delta["content"] = text
    return delta or None


def message(text: str, calls, reasoning: str = "") -> dict:
    """A non-streamed answer's message: content null when the answer is only calls, and
    the thinking as `reasoning_content` when there was some."""
    msg: dict = {"role": "assistant", "content": text if not calls else text or None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    return msg


def chat_tokens(engine, msgs: list[dict], tools, name: str, template_kwargs: dict | None = None) -> list[int]:
    """The chat prompt, with the tools rendered by the model's own template and
    `template_kwargs` (enable_thinking, ...) given to it; a template without tool support
    gets Ollama's 400, whose text clients match: "<model> does not support tools"."""
    try:
        return engine.chat_prompt(msgs, tools=tools, template_kwargs=template_kwargs)
    except ToolsUnsupportedError as exc:
        raise BadRequestError(exc.for_model(name)) from None


def _piece(engine, tok: int) -> str:
    return engine.backend.token_bytes(tok).decode("utf-8", errors="replace")


def _chat_logprobs(engine, tokens, chosen, tops, n_top: int) -> dict:
    content = []
    for tok, p, top in zip(tokens, chosen, tops):
        content.append(
            {
                "token": _piece(engine, tok),
                "logprob": logprob(p),
                "bytes": list(engine.backend.token_bytes(tok)),
                "top_logprobs": [
                    {"token": _piece(engine, t), "logprob": logprob(q), "bytes": list(engine.backend.token_bytes(t))}
                    for t, q in top[:n_top]
                ],
            }
        )
    return {"content": content}


def _text_logprobs(engine, tokens, chosen, tops, n_top: int, offset: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, p, top in zip(tokens, chosen, tops):
        piece = _piece(engine, tok)
        out["tokens"].append(piece)
        out["token_logprobs"].append(logprob(p))
        out["top_logprobs"].append({_piece(engine, t): logprob(q) for t, q in top[:n_top]})
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


async def chat_completions(request: Request):
    st = state(request)
    b = await st.body(request)
    want_lp = b.bool("logprobs", False)
    n_top = b.int("top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS) if want_lp else 0
    gen_request = await asyncio.to_thread(build_request, b, max(n_top, 1) if want_lp else 0, True, st.reasoning)
    # reads every call's arguments: off the loop, and a malformed one is a 400 before any model loads
    msgs = await asyncio.to_thread(history_messages, messages(b))
    streaming, include_usage = b.bool("stream", False), b.obj("stream_options").bool("include_usage", False)
    model = await st.manager.get(b.str("model"), b.get("keep_alive"))
    asked_for = b.str("model") or model.name  # Ollama's "does not support tools" names the model as asked
    tokens = await asyncio.to_thread(chat_tokens, model.engine, msgs, gen_request.tools, asked_for,
                                     gen_request.template_kwargs)
    job = await submit(model, tokens, gen_request)
    cid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model.name
    eng = model.engine

    def chunk(delta: dict, finish=None, lp=None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name, "choices": [choice]}

    if streaming:

        async def body():
            yield sse(chunk({"role": "assistant", "content": ""}))
            thought = 0  # tokens of thinking, for the usage chunk
            try:
                async for ev in events(model, job):
                    thought += reasoning_tokens(ev)
                    lp = _chat_logprobs(eng, ev.tokens, ev.token_probs or [], ev.top_probs or [], n_top) if want_lp else None
                    delta = chat_delta(ev.reasoning, ev.text, lp is not None)
                    if delta is not None:
                        yield sse(chunk(delta, lp=lp))
                    for delta in _call_deltas(ev.tool_calls or ()):
                        yield sse(chunk(delta))
                    if ev.finish_reason:
                        yield sse(chunk({}, _finish(ev.finish_reason)))
                        if include_usage:
                            usage = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                     "model": name, "choices": [], "usage": _usage(ev.timings, thought)}
                            yield sse(usage)
            except Exception as exc:  # the stream has begun: report in-band
                yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            yield b"data: [DONE]\n\n"

        return stream(request, body(), "text/event-stream", lambda: model.scheduler.cancel(job))
    res: Result = await collect(request, model, job)

    def answer() -> dict:  # logprobs grow with the answer: built and encoded off the loop
        choice = {
            "index": 0,
            "message": message(res.text, collect_calls(res.tool_calls), res.reasoning),
            "logprobs": _chat_logprobs(eng, res.tokens, res.token_probs, res.top_probs, n_top) if want_lp else None,
            "finish_reason": _finish(res.finish_reason),
        }
        return {"id": cid, "object": "chat.completion", "created": created, "model": name,
                "choices": [choice], "usage": _usage(res.timings, res.reasoning_tokens),
                "timings": _llama_timings(res.timings)}

    return await json_response(answer)


async def completions(request: Request):
    st = state(request)
    b = await st.body(request)
    n_top = b.int("logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    # a raw prompt: the answer is the raw text, thinking markup and all
    gen_request = await asyncio.to_thread(build_request, b, n_top, False, st.reasoning.raw())
    if b.bool("echo", False):
        raise BadRequestError("'echo' is not supported; send echo: false")
    prompt = b.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one prompt
    suffix = b.str("suffix")
    if suffix is not None and not isinstance(prompt, str):
        raise BadRequestError("'prompt' must be a string when 'suffix' is given")
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPT_TOKENS:
        raise BadRequestError(f"'prompt' may hold at most {MAX_PROMPT_TOKENS} token ids, got {len(prompt)}")
    if not isinstance(prompt, str) and not (
        isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise BadRequestError("'prompt' must be a string or a list of token ids")
    streaming, include_usage = b.bool("stream", False), b.obj("stream_options").bool("include_usage", False)
    model = await st.manager.get(b.str("model"), b.get("keep_alive"))
    eng = model.engine
    if suffix is not None:
        tokens = await asyncio.to_thread(fim_tokens, eng, prompt, suffix, name=model.name)
        gen_request = fim_request(gen_request)
    elif isinstance(prompt, str):
        tokens = await asyncio.to_thread(eng.tokenize, prompt)
    else:
        tokens = list(prompt)
    job = await submit(model, tokens, gen_request)
    cid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model.name

    def chunk(text: str, finish=None, lp=None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return {"id": cid, "object": "text_completion", "created": created, "model": name, "choices": [choice]}

    if streaming:

        async def body():
            offset = 0
            try:
                async for ev in events(model, job):
                    lp = _text_logprobs(eng, ev.tokens, ev.token_probs or [], ev.top_probs or [], n_top, offset) if n_top else None
                    offset += len(ev.text)
                    if ev.text or ev.finish_reason or lp:
                        yield sse(chunk(ev.text, _finish(ev.finish_reason), lp))
                    if ev.finish_reason and include_usage:
                        usage = {"id": cid, "object": "text_completion", "created": created, "model": name,
                                 "choices": [], "usage": _usage(ev.timings)}
                        yield sse(usage)
            except Exception as exc:
                yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            yield b"data: [DONE]\n\n"

        return stream(request, body(), "text/event-stream", lambda: model.scheduler.cancel(job))
    res = await collect(request, model, job)

    def answer() -> dict:  # logprobs grow with the answer: built and encoded off the loop
        lp = _text_logprobs(eng, res.tokens, res.token_probs, res.top_probs, n_top, 0) if n_top else None
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"index": 0, "text": res.text, "logprobs": lp, "finish_reason": _finish(res.finish_reason)}],
                "usage": _usage(res.timings), "timings": _llama_timings(res.timings)}

    return await json_response(answer)


async def list_models(request: Request):
    st = state(request)
    now = int(time.time())
    data = [{"id": name, "object": "model", "created": now, "owned_by": "localrun"} for name, _ in await st.manager.available()]
    return JSONResponse({"object": "list", "data": data})


async def embeddings(request: Request):
    st = state(request)
    b = await st.body(request)
    encoding = b.str("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadRequestError(f"'encoding_format' must be \"float\" or \"base64\", got {encoding!r}")
    model = await st.manager.get(b.str("model"), b.get("keep_alive"))
    vectors, n_tokens = await embed_inputs(model, b, "input")
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        vectors = [base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() for v in vectors]
    data = [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)]
    # up to 2,048 vectors of n_embd floats (~25 MB of JSON): encoded off the loop
    return await json_response(
        {"object": "list", "data": data, "model": model.name, "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
    )


def _llama_timings(t) -> dict:
    """llama-server adds these to its /v1 answers; some clients show them."""
    return {
        "prompt_n": t.prompt_tokens - t.cached_tokens,
        "prompt_ms": t.prefill_ms,
        "predicted_n": t.generated_tokens,
        "predicted_ms": t.decode_ms,
        "cache_n": t.cached_tokens,
    }


# This dialect's routes, in one place (app.py mounts the three lists).
ROUTES = [
    Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
    Route("/v1/completions", endpoint(completions), methods=["POST"]),
    Route("/v1/models", endpoint(list_models), methods=["GET"]),
    Route("/v1/embeddings", endpoint(embeddings), methods=["POST"]),
]

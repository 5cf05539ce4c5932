"""The Ollama dialect: /api/chat (with tools), /api/generate (suffix = fill-in-the-middle,
raw, format, options, keep_alive), /api/tags, /api/show, /api/ps, /api/version,
/api/embed. Streams are NDJSON (streaming is Ollama's default) ending in an object with
`done: true` and Ollama's timing fields, in nanoseconds. A tool call comes whole, in a
chunk of its own, its arguments an object.

Thinking comes apart from the answer: `message.thinking` (/api/chat) or `thinking`
(/api/generate), streamed in chunks of its own. `think` (true, false, "low", "medium",
"high") reaches the template as enable_thinking / reasoning_effort (reasoning.py); an
assistant message's `thinking` in the history reaches it as `reasoning_content`. A raw
or fill-in-the-middle generate answers the raw text."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

from starlette.requests import Request
from starlette.routing import Route
from starlette.responses import JSONResponse

from ..errors import BadRequestError
from ..grammar.core import Grammar
from ..request import MAX_PROMPT_TOKENS, MAX_TOKENS_LIMIT, GenerationRequest
from ..tools import collect_calls, history_messages
from .describe import describe
from .fields import Body, generation_request, messages, sampling_params, schema_grammar, tool_fields
from .fim import fim_request, fim_tokens
from .http import ndjson, stream
from .keep_alive import parse_keep_alive
from .openai_api import chat_tokens
from .reasoning import NO_REASONING, Reasoning, ollama
from .runner import collect, events, submit
from .state import embed_inputs, endpoint, json_response, state

OLLAMA_VERSION = "0.12.0"  # the API generation these routes follow


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def build_request(b: Body, chat: bool = False, reasoning: Reasoning = NO_REASONING) -> GenerationRequest:
    """The body's GenerationRequest (with its tools for a chat, and `reasoning`, the
    controls already merged with the server's); compiles its format and the tools'
    schemas, so call it off the event loop."""
    tools = tool_fields(b, ("format",)) if chat else {}  # refused with a format before it compiles
    opts = b.obj("options")
    predict = opts.int("num_predict", hi=MAX_TOKENS_LIMIT)
    # Ollama: -1 = no limit, -2 = fill the context; both mean "to the end of the context" here
    max_tokens = None if predict is None or predict < 0 else predict
    fmt = b.get("format")
    if fmt is None or fmt == "":
        grammar = None
    elif fmt == "json":
        grammar = Grammar.json_object()
    elif isinstance(fmt, dict):
        grammar = schema_grammar(fmt, "format")
    else:
        raise BadRequestError(f"'format' must be \"json\" or a JSON schema object, got {fmt!r}")
    return generation_request(opts, sampling_params(opts), max_tokens, grammar, **tools, **reasoning.request_fields())


def _final(t, load_ns: int, started: float) -> dict:
    total = int((time.perf_counter() - started) * 1e9)
    prompt = int(t.prefill_ms * 1e6)
    evaluating = int(t.decode_ms * 1e6)
    if t.generated_tokens and not evaluating:
        # one token, sampled from the prompt's own forward pass: the answer's time is what
        # followed the prompt (clients divide eval_count by this, so never 0)
        evaluating = max(total - load_ns - prompt, 1)
    return {
        "total_duration": total,
        "load_duration": load_ns,
        "prompt_eval_count": t.prompt_tokens,
        "prompt_eval_duration": prompt,
        "eval_count": t.generated_tokens,
        "eval_duration": evaluating,
    }


def _done_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"  # Ollama says "stop" after tool calls too


class WholeCalls:
    """Ollama streams each tool call whole, its arguments an object: a call's deltas wait
    here until the next call begins or the answer ends."""

    def __init__(self) -> None:
        self._current: list = []  # the deltas of the call being written (one index)

    def add(self, deltas) -> list[dict]:
        done = []
        for d in deltas:
            if self._current and d.index != self._current[0].index:
                done += self.finish()
            self._current.append(d)
        return done

    def finish(self) -> list[dict]:
        """The call being written, if any, as Ollama's {"function": {index, name, arguments}}."""
        if not self._current:
            return []
        index, calls = self._current[0].index, collect_calls(self._current)
        self._current = []
        return whole_calls(calls, index)


def whole_calls(calls, first_index: int = 0) -> list[dict]:
    """Ollama's `message.tool_calls`: {"function": {"index", "name", "arguments": {...}}}.
    A call cut off by the token limit (done_reason "length") has no whole arguments
    object to give, and is left out."""
    out = []
    for i, call in enumerate(calls, first_index):
        try:
            arguments = call.arguments_obj()
        except ValueError:
            continue
        out.append({"function": {"index": i, "name": call.name, "arguments": arguments}})
    return out


def chat_message(text: str, calls: list[dict] | None = None, thinking: str = "") -> dict:
    message = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return {"message": message}


def generate_piece(text: str, calls=None, thinking: str = "") -> dict:
    return {"response": text, "thinking": thinking} if thinking else {"response": text}


async def _load_only(st, b: Body, name: str, key: str, empty) -> JSONResponse:
    """Ollama loads (or, with keep_alive 0, unloads) a model on a request without input."""
    keep = b.get("keep_alive")
    if keep is not None and parse_keep_alive(keep) == 0:
        display, _ = await st.manager.resolve(name)
        st.manager.expire(display)
        await st.manager.reap(grace=0)  # now if idle; else once its last client is done
        return JSONResponse({"model": name, "created_at": _now(), key: empty, "done": True, "done_reason": "unload"})
    await st.manager.get(name, keep, _num_ctx(b))
    return JSONResponse({"model": name, "created_at": _now(), key: empty, "done": True, "done_reason": "load"})


async def _answer(request: Request, model, job, streaming: bool, name: str, shape, load_ns: int, started: float, tokens):
    """Stream (default) or one object; `shape(text, calls, thinking)` wraps a piece of
    output, its whole tool calls (only a chat has tools) and its thinking."""
    if streaming:

        async def body():
            calls = WholeCalls()
            try:
                async for ev in events(model, job):
                    if ev.reasoning:  # in a chunk of its own, as Ollama sends it
                        yield ndjson({"model": name, "created_at": _now(), **shape("", None, ev.reasoning), "done": False})
                    if ev.text:
                        yield ndjson({"model": name, "created_at": _now(), **shape(ev.text), "done": False})
                    done = calls.add(ev.tool_calls or ()) + (calls.finish() if ev.finish_reason else [])
                    for call in done:  # each call whole, in a chunk of its own
                        yield ndjson({"model": name, "created_at": _now(), **shape("", [call]), "done": False})
                    if ev.finish_reason:
                        final = {"model": name, "created_at": _now(), **shape(""), "done": True,
                                 "done_reason": _done_reason(ev.finish_reason), **_final(ev.timings, load_ns, started)}
                        if tokens is not None:
                            final["context"] = _context(job, tokens, job.gen.output)
                        yield ndjson(final)
            except Exception as exc:  # the stream has begun: report in-band
                yield ndjson({"error": str(exc)})

        return stream(request, body(), "application/x-ndjson", lambda: model.scheduler.cancel(job))
    res = await collect(request, model, job)
    calls = whole_calls(collect_calls(res.tool_calls))
    out = {"model": name, "created_at": _now(), **shape(res.text, calls, res.reasoning), "done": True,
           "done_reason": _done_reason(res.finish_reason), **_final(res.timings, load_ns, started)}
    if tokens is not None:
        out["context"] = _context(job, tokens, res.tokens)
    return await json_response(out)  # "context" holds up to the context length of ids: encoded off the loop


def _context(job, tokens: list[int], output: list[int]) -> list[int]:
    """Ollama's `context`: the prompt as the model read it (token healing may have taken
    its last tokens off: the answer wrote them again), then the answer."""
    return (job.gen.prompt if job.gen is not None else tokens) + output


async def _model(st, b: Body):
    name = b.str("model") or b.str("name")
    if not name:
        raise BadRequestError("'model' is required")
    t0 = time.perf_counter()
    loaded_before = (await st.manager.resolve(name))[0] in st.manager.loaded
    model = await st.manager.get(name, b.get("keep_alive"), _num_ctx(b))
    return name, model, 0 if loaded_before else int((time.perf_counter() - t0) * 1e9)


def _num_ctx(b: Body) -> int | None:
    """`options.num_ctx`: the context the model must be loaded with, at least (Ollama
    reloads a model for a larger one; a smaller one is served by the larger context, and a
    prompt is never cut to fit: it is refused with the context's size instead)."""
    return b.obj("options").int("num_ctx", lo=16, hi=MAX_PROMPT_TOKENS)


async def chat(request: Request):
    st = state(request)
    started = time.perf_counter()
    b = await st.body(request)
    name = b.str("model") or b.str("name")
    if not b.list("messages"):
        return await _load_only(st, b, name or "", "message", {"role": "assistant", "content": ""})
    # reads every call's arguments: off the loop, and a malformed one is a 400 before any model loads
    msgs = await asyncio.to_thread(history_messages, messages(b))
    gen_request = await asyncio.to_thread(build_request, b, True, ollama(b).over(st.reasoning))
    streaming = b.bool("stream", True)
    name, model, load_ns = await _model(st, b)
    tokens = await asyncio.to_thread(chat_tokens, model.engine, msgs, gen_request.tools, name,
                                     gen_request.template_kwargs)
    job = await submit(model, tokens, gen_request)
    return await _answer(request, model, job, streaming, name, chat_message, load_ns, started, None)


async def generate(request: Request):
    st = state(request)
    started = time.perf_counter()
    b = await st.body(request)
    prompt, suffix, system = b.str("prompt", ""), b.str("suffix"), b.str("system")
    if b.get("images"):
        raise BadRequestError("'images': this server reads text only")
    if not prompt and not suffix:
        return await _load_only(st, b, b.str("model") or b.str("name") or "", "response", "")
    streaming, raw = b.bool("stream", True), b.bool("raw", False)
    # a raw or fill-in-the-middle prompt skips the template: its answer is the raw text
    reasoning = st.reasoning.raw() if raw or suffix is not None else ollama(b).over(st.reasoning)
    gen_request = await asyncio.to_thread(build_request, b, False, reasoning)
    context = b.list("context", most=MAX_PROMPT_TOKENS) or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
        raise BadRequestError("'context' must be a list of token ids")
    name, model, load_ns = await _model(st, b)
    eng = model.engine
    if suffix is not None:
        tokens = await asyncio.to_thread(fim_tokens, eng, prompt, suffix, name=name)
        gen_request = fim_request(gen_request)
    elif raw:
        tokens = context + await asyncio.to_thread(eng.tokenize, prompt, not context)
    else:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        tokens = context + await asyncio.to_thread(eng.chat_prompt, msgs, template_kwargs=gen_request.template_kwargs)
    job = await submit(model, tokens, gen_request)
    return await _answer(request, model, job, streaming, name, generate_piece, load_ns, started, tokens)


async def tags(request: Request):
    st = state(request)
    out = []
    for name, path in await st.manager.available():
        try:
            d = await asyncio.to_thread(describe, name, path)
        except Exception:  # an unreadable file is left out of the list, not a failed listing
            continue
        out.append({"name": name, "model": name, "modified_at": d.modified_at, "size": d.size_bytes,
                    "digest": d.digest, "details": d.details()})
    return JSONResponse({"models": out})


async def show(request: Request):
    st = state(request)
    b = await st.body(request)
    name = b.str("model") or b.str("name")
    if not name:
        raise BadRequestError("'model' is required")
    display, path = await st.manager.resolve(name)
    loaded = st.manager.loaded.get(display)
    d = await asyncio.to_thread(describe, name, path, loaded.engine if loaded else None, st.manager.chat_template)
    arch = d.architecture
    # the context this server gives a request (what a client may fill), not the trained one
    served = loaded.engine.n_ctx if loaded else (await asyncio.to_thread(st.manager.context_for, path)).n_ctx
    info = {"general.architecture": arch, "general.parameter_count": d.n_params,
            f"{arch}.context_length": served, f"{arch}.embedding_length": d.embedding_length}
    return JSONResponse(
        {"modelfile": f"FROM {path}\n", "parameters": f"num_ctx {served}", "template": d.chat_template or "",
         "details": d.details(), "model_info": info, "capabilities": d.capabilities(), "modified_at": d.modified_at}
    )


async def ps(request: Request):
    st = state(request)
    out = []
    for name, model in st.manager.loaded.items():
        d = describe(name, model.path, model.engine)
        expires = model.expires_at
        until = datetime.fromtimestamp(expires if expires is not None else 253402300799, timezone.utc)
        out.append({"name": name, "model": name, "size": d.size_bytes, "digest": d.digest, "details": d.details(),
                    "expires_at": until.isoformat().replace("+00:00", "Z"), "size_vram": 0,
                    "context_length": model.engine.n_ctx})
    return JSONResponse({"models": out})


async def version(request: Request):
    return JSONResponse({"version": OLLAMA_VERSION, "localrun": state(request).version})


async def embed(request: Request):
    st = state(request)
    started = time.perf_counter()
    b = await st.body(request)
    name, model, load_ns = await _model(st, b)
    vectors, n_tokens = await embed_inputs(model, b, "input")
    # up to 2,048 vectors of n_embd floats: encoded off the loop
    return await json_response({"model": name, "embeddings": vectors,
                                "total_duration": int((time.perf_counter() - started) * 1e9),
                                "load_duration": load_ns, "prompt_eval_count": n_tokens})


# This dialect's routes, in one place (app.py mounts the three lists).
ROUTES = [
    Route("/api/chat", endpoint(chat), methods=["POST"]),
    Route("/api/generate", endpoint(generate), methods=["POST"]),
    Route("/api/tags", endpoint(tags), methods=["GET"]),
    Route("/api/show", endpoint(show), methods=["POST"]),
    Route("/api/ps", endpoint(ps), methods=["GET"]),
    Route("/api/version", endpoint(version), methods=["GET"]),
    Route("/api/embed", endpoint(embed), methods=["POST"]),
]

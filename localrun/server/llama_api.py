"""The llama-server dialect: /completion, /infill (llama.vim, llama.vscode), /tokenize,
/detokenize, /health, /props (with the template's tool capabilities), /slots, /metrics;
its /v1/chat/completions, tools included, is the OpenAI dialect's route. Requests may
name a `model`; without one they go to the server's first --model, as llama-server
serves one model.

/completion and /infill read a raw prompt and answer the raw text, thinking markup and
all, as llama-server does there; llama-server's `reasoning_content` is on its
/v1/chat/completions, the OpenAI dialect's route."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.routing import Route
from starlette.responses import JSONResponse, PlainTextResponse

from ..errors import BadRequestError, LocalrunError
from ..request import (
    MAX_FIELD_NAME_CHARS,
    MAX_INPUT_EXTRA,
    MAX_RESPONSE_FIELDS,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
)
from ..sampling import PARAMETERS
from .fields import Body, generation_request, grammar_from, sampling_params
from .reasoning import NO_REASONING, Reasoning
from .fim import fim_request, fim_tokens
from .http import sse, stream
from .runner import collect, events, logprob, submit
from .state import check_text_fits, endpoint, json_response, state


def build_request(b: Body, reasoning: Reasoning = NO_REASONING) -> GenerationRequest:
    """The body's GenerationRequest; compiles its grammar, so call it off the event loop.
    `reasoning`: the route's controls (raw text on these routes)."""
    n_predict = b.int("n_predict", hi=MAX_TOKENS_LIMIT)
    if n_predict is None:
        n_predict = b.int("max_tokens", hi=MAX_TOKENS_LIMIT)
    return generation_request(
        b,
        sampling_params(b, n_probs=b.int("n_probs", 0, lo=0, hi=MAX_TOP_LOGPROBS)),
        None if n_predict is None or n_predict < 0 else n_predict,  # -1: to the end of the context
        grammar_from(b),
        ignore_eos=b.bool("ignore_eos", False),
        t_max_predict_ms=b.float("t_max_predict_ms"),
        n_indent=b.int("n_indent", 0, lo=0),
        **reasoning.request_fields(),
    )


def _prompt_tokens(eng, prompt) -> list[int]:
    """A string, a list of token ids, or a list mixing strings and ids (llama-server's forms)."""
    if isinstance(prompt, str):
        return eng.tokenize(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _prompt_tokens(eng, prompt[0])
    if isinstance(prompt, list) and prompt:
        out: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, int) and not isinstance(part, bool):
                out.append(part)
            elif isinstance(part, str):
                out.extend(eng.tokenize(part, add_special=not out))
            else:
                raise BadRequestError(f"'prompt[{i}]' must be a token id or a string")
        return out
    raise BadRequestError("'prompt' must be a string or a list of token ids")


def _probs(eng, tokens, chosen, tops) -> list[dict]:
    piece = lambda t: eng.backend.token_bytes(t).decode("utf-8", errors="replace")  # noqa: E731
    return [
        {"id": tok, "token": piece(tok), "logprob": logprob(p), "bytes": list(eng.backend.token_bytes(tok)),
         "top_logprobs": [{"id": t, "token": piece(t), "logprob": logprob(q)} for t, q in top]}
        for tok, p, top in zip(tokens, chosen, tops)
    ]


def _stop_type(job, reason: str) -> str:
    """llama-server's names: "limit" (n_predict or time), "word" (a stop string), "eos"."""
    if reason == "length":
        return "limit"
    return "word" if job.gen is not None and job.gen.stops.matched else "eos"


def _timings(t) -> dict:
    prompt_n = t.prompt_tokens - t.cached_tokens
    return {
        "cache_n": t.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": t.prefill_ms,
        "prompt_per_token_ms": t.prefill_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": t.prefill_tps,
        "predicted_n": t.generated_tokens,
        "predicted_ms": t.decode_ms,
        "predicted_per_token_ms": t.decode_ms / t.decode_tokens if t.decode_tokens else 0.0,
        "predicted_per_second": t.decode_tps,
        "draft_n": t.drafted,
        "draft_n_accepted": t.accepted,
    }


def _read_run_fields(b: Body) -> dict:
    """Every field `_run` reads, checked before a job exists (a refused request never runs)."""
    fields = b.list("response_fields", most=MAX_RESPONSE_FIELDS)
    if fields is not None and not all(isinstance(f, str) and len(f) <= MAX_FIELD_NAME_CHARS for f in fields):
        raise BadRequestError(
            f"'response_fields' must be a list of field names of at most {MAX_FIELD_NAME_CHARS} characters"
        )
    return {"stream": b.bool("stream", False), "fields": fields}


def _project(out: dict, fields: list[str] | None) -> dict:
    """llama-server's response_fields: only these, nested ones as "timings/prompt_n" keys."""
    if not fields:
        return out
    picked = {}
    for path in fields:
        value = out
        for part in path.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            picked[path] = value
    return picked


async def _run(request: Request, run: dict, model, tokens: list[int], gen_request: GenerationRequest):
    job = await submit(model, tokens, gen_request)
    eng, n_probs = model.engine, gen_request.sampling.n_probs

    def final(text: str, out_tokens: list[int], reason: str, t) -> dict:
        return {
            "index": 0, "content": text, "tokens": out_tokens, "id_slot": job.gen.seq if job.gen else -1,
            "stop": True, "model": model.name, "tokens_predicted": t.generated_tokens,
            "tokens_evaluated": t.prompt_tokens, "tokens_cached": t.cached_tokens, "truncated": False,
            "stop_type": _stop_type(job, reason), "stopping_word": (job.gen.stops.matched or "") if job.gen else "",
            "has_new_line": "\n" in text, "timings": _timings(t),
        }

    if run["stream"]:

        async def body():
            try:
                async for ev in events(model, job):
                    if ev.finish_reason:
                        last = final(ev.text, ev.tokens, ev.finish_reason, ev.timings)
                        if n_probs:
                            last["completion_probabilities"] = _probs(eng, ev.tokens, ev.token_probs or [], ev.top_probs or [])
                        yield sse(last)
                    elif ev.text or ev.tokens:
                        piece = {"index": 0, "content": ev.text, "tokens": ev.tokens, "stop": False,
                                 "id_slot": job.gen.seq if job.gen else -1}
                        if n_probs:
                            piece["completion_probabilities"] = _probs(eng, ev.tokens, ev.token_probs or [], ev.top_probs or [])
                        yield sse(piece)
            except Exception as exc:  # the stream has begun: report in-band, with the status it would have had
                code = exc.http_status if isinstance(exc, LocalrunError) else 500
                kind = "invalid_request_error" if code < 500 else "server_error"
                yield sse({"error": {"code": code, "message": str(exc), "type": kind}})

        return stream(request, body(), "text/event-stream", lambda: model.scheduler.cancel(job))
    res = await collect(request, model, job)

    def answer() -> dict:  # n_probs entries per token: built and encoded off the loop
        out = final(res.text, res.tokens, res.finish_reason, res.timings)
        if n_probs:
            out["completion_probabilities"] = _probs(eng, res.tokens, res.token_probs, res.top_probs)
        return _project(out, run["fields"])

    return await json_response(answer)


async def completion(request: Request):
    st = state(request)
    b = await st.body(request)
    if b.get("prompt") is None:
        raise BadRequestError("'prompt' is required")
    gen_request, run = await asyncio.to_thread(build_request, b, st.reasoning.raw()), _read_run_fields(b)
    model = await st.manager.get(b.str("model"))
    tokens = await asyncio.to_thread(_prompt_tokens, model.engine, b.get("prompt"))
    return await _run(request, run, model, tokens, gen_request)


async def infill(request: Request):
    st = state(request)
    b = await st.body(request)
    prefix, suffix, middle = b.str("input_prefix", ""), b.str("input_suffix", ""), b.str("prompt", "")
    extra = []
    for i, chunk in enumerate(b.list("input_extra", most=MAX_INPUT_EXTRA) or []):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str):
            raise BadRequestError(f"'input_extra[{i}]' must be an object with 'filename' and 'text' strings")
        extra.append((str(chunk.get("filename") or ""), chunk.get("text", "")))
    gen_request, run = await asyncio.to_thread(build_request, b, st.reasoning.raw()), _read_run_fields(b)
    model = await st.manager.get(b.str("model"))
    tokens = await asyncio.to_thread(fim_tokens, model.engine, prefix, suffix, extra, middle, name=model.name)
    return await _run(request, run, model, tokens, fim_request(gen_request))


# /tokenize and /detokenize take and return at most the model's context length in tokens
# (engine.n_ctx, what `serve` printed at load): nothing longer can be a prompt of this
# model, and the answer stays small (a 7.5 MB text was 2.35 M tokens, 165 MB of JSON
# with pieces). A text is refused before tokenizing when its size alone proves it too long.


async def tokenize(request: Request):
    st = state(request)
    b = await st.body(request)
    content = b.str("content", required=True)
    eng = (await st.manager.get(b.str("model"))).engine
    add_special, parse_special = b.bool("add_special", False), b.bool("parse_special", True)
    with_pieces = b.bool("with_pieces", False)

    def answer() -> dict:  # grows with the text: off the event loop
        check_text_fits(eng, content, "content", eng.n_ctx)
        ids = eng.backend.tokenize(content, add_special, parse_special)
        if len(ids) > eng.n_ctx:
            raise BadRequestError(
                f"'content' holds {len(ids):,} tokens; /tokenize answers at most {eng.n_ctx:,} (the model's context length)"
            )
        if not with_pieces:
            return {"tokens": ids}
        pieces = []
        for t in ids:
            raw = eng.backend.token_bytes(t) or eng.backend.token_text(t).encode()
            try:
                pieces.append({"id": t, "piece": raw.decode("utf-8")})
            except UnicodeDecodeError:  # part of a multi-byte character: llama-server sends the bytes
                pieces.append({"id": t, "piece": list(raw)})
        return {"tokens": pieces}

    return await json_response(answer)


async def detokenize(request: Request):
    st = state(request)
    b = await st.body(request)
    ids = b.list("tokens", required=True)
    eng = (await st.manager.get(b.str("model"))).engine
    n_vocab = eng.info.n_vocab
    if len(ids) > eng.n_ctx:
        raise BadRequestError(f"'tokens' holds {len(ids):,} ids; at most {eng.n_ctx:,} (the model's context length)")

    def detokenize() -> dict:  # grows with the list: off the event loop
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < n_vocab:
                raise BadRequestError(f"'tokens[{i}]' must be a token id in 0..{n_vocab - 1}")
        return {"content": eng.detokenize(ids)}

    return await json_response(detokenize)


async def health(request: Request):
    return JSONResponse({"status": "ok"})


async def props(request: Request):
    st = state(request)
    model = await st.manager.get(None)
    eng = model.engine
    return JSONResponse(
        {
            "default_generation_settings": {"n_ctx": eng.n_ctx, "params": {"n_predict": -1, **_default_sampling(st)}},
            "total_slots": eng.backend.n_seq,
            "model_path": model.path,
            "model_alias": model.name,
            "chat_template": eng.chat_template,
            # llama-server's names (common/jinja/caps.h); clients check supports_tools before sending tools
            "chat_template_caps": {
                "supports_tools": eng.supports_tools,
                "supports_tool_calls": eng.supports_tools,
                "supports_parallel_tool_calls": eng.supports_tools,
            },
            "modalities": {"vision": False, "audio": False},
            "build_info": f"localrun {st.version}",
        }
    )


def _default_sampling(st) -> dict:
    """The sampler values a request that sets none gets (serve's --temp, ... over the
    defaults), as llama-server's /props lists them; a random seed is -1."""
    p = sampling_params(Body({}, sampling=st.sampling))
    out = {spec.name: getattr(p, spec.name) for spec in PARAMETERS if spec.body and spec.kind in ("int", "float")}
    out["seed"] = -1 if p.seed is None else p.seed
    return out


async def slots(request: Request):
    st = state(request)
    out = []
    for model in st.manager.loaded.values():
        out.extend(dict(s, model=model.name) for s in model.scheduler.slots())
    return JSONResponse(out)


METRICS = (
    ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", lambda s, p, d: s.prompt_tokens),
    ("prompt_seconds_total", "counter", "Prompt process time.", lambda s, p, d: s.prompt_seconds),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed.", lambda s, p, d: s.predicted_tokens),
    ("tokens_predicted_seconds_total", "counter", "Predict process time.", lambda s, p, d: s.predicted_seconds),
    ("n_decode_total", "counter", "Total number of llama_decode() calls.", lambda s, p, d: s.decode_calls),
    ("requests_processing", "gauge", "Number of requests processing.", lambda s, p, d: p),
    ("requests_deferred", "gauge", "Number of requests deferred.", lambda s, p, d: d),
)


async def metrics(request: Request):
    st = state(request)
    lines = []
    for name, kind, text, read in METRICS:
        lines += [f"# HELP llamacpp:{name} {text}", f"# TYPE llamacpp:{name} {kind}"]
        for model in st.manager.loaded.values():
            processing, deferred = model.scheduler.counts()
            value = read(model.scheduler.stats, processing, deferred)
            label = model.name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            lines.append(f'llamacpp:{name}{{model="{label}"}} {value}')
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


# This dialect's routes, in one place (app.py mounts the three lists).
ROUTES = [
    Route("/completion", endpoint(completion), methods=["POST"]),
    Route("/infill", endpoint(infill), methods=["POST"]),
    Route("/tokenize", endpoint(tokenize), methods=["POST"]),
    Route("/detokenize", endpoint(detokenize), methods=["POST"]),
    Route("/health", endpoint(health), methods=["GET"]),
    Route("/props", endpoint(props), methods=["GET"]),
    Route("/slots", endpoint(slots), methods=["GET"]),
    Route("/metrics", endpoint(metrics), methods=["GET"]),
]

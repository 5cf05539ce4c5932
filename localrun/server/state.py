"""What every route shares: the server's state and `endpoint`, the wrapper that turns
every foreseeable failure into the dialect's error body (a bad request never takes the
server down, and never answers 5xx). Each dialect module lists its own routes (ROUTES)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import weakref
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from .. import __version__
from ..errors import BadRequestError, LocalrunError
from .fields import Body
from .http import ClientDisconnected, error_response, read_json
from .models import Loaded, ModelManager
from .reasoning import NO_REASONING, Reasoning

log = logging.getLogger("localrun.server")


@dataclass
class ServerState:
    manager: ModelManager
    body_limit: int = 8 * 1024 * 1024
    started: float = field(default_factory=time.time)
    version: str = __version__
    reasoning: Reasoning = NO_REASONING  # serve's --reasoning-budget / --reasoning-format
    # serve's --temp, --top-k, --top-p, --min-p, --seed: SamplingParams fields a request may leave out
    sampling: dict = field(default_factory=dict)

    async def body(self, request: Request) -> Body:
        return Body(await read_json(request, self.body_limit), sampling=self.sampling)


def state(request: Request) -> ServerState:
    return request.app.state.localrun


def endpoint(handler):
    """A route's handler, with every LocalrunError turned into the dialect's error body and
    its status, and any other exception into a logged 500 (the server keeps serving)."""

    @functools.wraps(handler)
    async def guarded(request: Request):
        try:
            return await handler(request)
        except LocalrunError as exc:
            return error_response(request.url.path, exc.http_status, str(exc))
        except ClientDisconnected:  # its generation is cancelled already: one line, not an ASGI traceback
            log.info("%s %s: the client hung up before its answer was ready; its generation was cancelled",
                     request.method, request.url.path)
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: say so, keep serving; its text may hold anything, so only the log gets it
            log.exception("internal error in %s %s", request.method, request.url.path)
            return error_response(request.url.path, 500, "internal error (see the server log)")

    return guarded


# -- responses whose size grows with the request -----------------------------------------

# Lists longer than this are encoded item by item (each item by the C encoder), so the
# thread encoding a big answer lets the event loop take the GIL between items: one
# json.dumps of a 165 MB answer held it for seconds (issue 49), even off the loop.
_ENCODE_WHOLE_ITEMS = 256


def _json_parts(obj, dumps, out: list[str]) -> None:
    if isinstance(obj, list) and len(obj) > _ENCODE_WHOLE_ITEMS:
        out.append("[")
        for i, item in enumerate(obj):
            if i:
                out.append(",")
            _json_parts(item, dumps, out)
        out.append("]")
    elif isinstance(obj, dict) and any(isinstance(v, (list, dict)) for v in obj.values()):
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(("," if i else "") + dumps(str(key)) + ":")
            _json_parts(value, dumps, out)
        out.append("}")
    else:
        out.append(dumps(obj))


def json_bytes(obj) -> bytes:
    """`obj` as JSONResponse writes it (UTF-8, no spaces), for a big answer."""
    dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    out: list[str] = []
    _json_parts(obj, dumps, out)
    return "".join(out).encode("utf-8")


async def json_response(build, status_code: int = 200) -> Response:
    """A JSON answer whose size grows with the request (token lists, pieces, logprobs,
    embeddings): `build()` makes the object and it is encoded in a worker thread, never on
    the event loop every client shares. `build` may also be the object itself."""

    def make() -> bytes:
        return json_bytes(build() if callable(build) else build)

    return Response(await asyncio.to_thread(make), status_code=status_code, media_type="application/json")


# a model's longest token in bytes (its spelling for a control token), read once per engine
_LONGEST_TOKEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def longest_token_bytes(eng) -> int:
    """The most bytes one token of `eng`'s vocabulary stands for: a text of more than
    n * this bytes holds more than n tokens, whatever the tokenizer does (~4 ms for 49k
    tokens; call it off the loop)."""
    n = _LONGEST_TOKEN.get(eng)
    if n is None:
        backend = eng.backend
        # a control token's piece is empty; with parse_special its spelling is one token
        n = max(len(backend.token_bytes(t) or backend.token_text(t).encode("utf-8", "replace"))
                for t in range(eng.info.n_vocab))
        _LONGEST_TOKEN[eng] = n = max(1, n)
    return n


def check_text_fits(eng, text: str, field: str, most: int) -> None:
    """Refuse, before tokenizing it, a text that must hold more than `most` tokens: its
    UTF-8 size is beyond `most` of the model's longest tokens. Tokenizing runs at ~1.6 MB/s
    (7.5 MB: 4.7 s, 2.35 M tokens on SmolLM2), so nothing that long is worth tokenizing
    only to be refused."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > most * longest_token_bytes(eng):
        raise BadRequestError(
            f"'{field}' is {size:,} bytes: more than {most:,} tokens (the model's context length) can hold;"
            f" send at most {most:,} tokens of text"
        )


MAX_EMBED_INPUTS = 2048  # OpenAI's limit on `input` items


async def embed_inputs(model: Loaded, b: Body, key: str) -> tuple[list[list[float]], int]:
    """Embeddings of a body's string or list of strings (OpenAI `input`, Ollama `input`)."""
    raw = b.get(key)
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequestError(f"'{key}' must be a string or a non-empty list of strings")
    if len(texts) > MAX_EMBED_INPUTS:
        raise BadRequestError(f"'{key}' holds {len(texts)} texts; at most {MAX_EMBED_INPUTS} per request")
    eng = model.engine

    def tokenize_all() -> list[list[int]]:
        for i, t in enumerate(texts):  # a 7 MB text is refused before it is tokenized
            check_text_fits(eng, t, f"{key}[{i}]", eng.n_ctx)
        return [eng.tokenize(t) for t in texts]

    token_lists = await asyncio.to_thread(tokenize_all)
    for i, toks in enumerate(token_lists):
        if not toks:
            raise BadRequestError(f"'{key}[{i}]' is empty")
        if len(toks) > eng.n_ctx:
            raise BadRequestError(f"'{key}[{i}]' has {len(toks)} tokens; the context holds {eng.n_ctx}")
    # one text per call: the streams on this model take their steps between two texts
    vectors = [await model.scheduler.call(lambda t=t: eng.backend.embed(t).tolist()) for t in token_lists]
    return vectors, sum(len(t) for t in token_lists)

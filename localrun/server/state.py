"""What every route shares: the server's state and `endpoint`, the wrapper that turns
every foreseeable failure into the dialect's error body (a bad request never takes the
server down, and never answers 5xx). Each dialect module lists its own routes (ROUTES)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field

from starlette.requests import Request

from .. import __version__
from ..errors import BadRequestError, LocalrunError
from .fields import Body
from .http import error_response, read_json
from .models import Loaded, ModelManager

log = logging.getLogger("localrun.server")


@dataclass
class ServerState:
    manager: ModelManager
    body_limit: int = 8 * 1024 * 1024
    started: float = field(default_factory=time.time)
    version: str = __version__

    async def body(self, request: Request) -> Body:
        return Body(await read_json(request, self.body_limit))


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
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: say so, keep serving; its text may hold anything, so only the log gets it
            log.exception("internal error in %s %s", request.method, request.url.path)
            return error_response(request.url.path, 500, "internal error (see the server log)")

    return guarded


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
    token_lists = await asyncio.to_thread(lambda: [eng.tokenize(t) for t in texts])
    for i, toks in enumerate(token_lists):
        if not toks:
            raise BadRequestError(f"'{key}[{i}]' is empty")
        if len(toks) > eng.n_ctx:
            raise BadRequestError(f"'{key}[{i}]' has {len(toks)} tokens; the context holds {eng.n_ctx}")
    # one text per call: the streams on this model take their steps between two texts
    vectors = [await model.scheduler.call(lambda t=t: eng.backend.embed(t).tolist()) for t in token_lists]
    return vectors, sum(len(t) for t in token_lists)

"""The ASGI app: the three dialects' routes behind the guard and the lease scope, plus
the housekeeping task that unloads idle models."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request

from . import anthropic_api, llama_api, ollama_api, openai_api, responses_api
from .http import Guard, error_response
from .models import ModelManager, request_scope
from .state import ServerState

REAP_INTERVAL_S = 1.0
log = logging.getLogger("localrun.server")


class LeaseScope:
    """ASGI wrapper: each HTTP request holds the models it resolves (models.RequestLeases)
    until its response is over. They are let go just before the response's last message
    goes out, so a client that has read the whole answer never finds its model still
    held, and in any case when the call ends (a hang-up, an error, a cancel); by then a
    stream's generation has ended or been cancelled, and a busy scheduler still protects
    a step that has not noticed yet."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        with request_scope() as leases:

            async def send_then_let_go(message) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    leases.release()
                await send(message)

            await self.app(scope, receive, send_then_let_go)


def build_app(
    manager: ModelManager,
    loopback: bool = True,
    origins: list[str] | None = None,
    api_key: str | None = None,
    body_limit: int = 8 * 1024 * 1024,
    bound_host: str = "",
    reasoning=None,
    sampling: dict | None = None,
):
    """`reasoning`: the server's default reasoning controls (a Reasoning, from
    reasoning_options.reasoning_defaults); `sampling`: its default sampler values
    (SamplingParams fields, from sampling_options.sampling_defaults). A request's own
    controls and values win."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def reap_forever():
            while True:
                await asyncio.sleep(REAP_INTERVAL_S)
                try:
                    await manager.reap()
                except Exception:  # a failed round is logged; the next one still runs
                    log.exception("unloading idle models failed")

        reaper = asyncio.create_task(reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            await manager.close()

    async def http_error(request: Request, exc: HTTPException):
        return error_response(request.url.path, exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")

    app = Starlette(routes=[*anthropic_api.ROUTES, *responses_api.ROUTES, *openai_api.ROUTES, *ollama_api.ROUTES, *llama_api.ROUTES], lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.localrun = ServerState(manager, body_limit)
    if reasoning is not None:
        app.state.localrun.reasoning = reasoning
    app.state.localrun.sampling = dict(sampling or {})
    return Guard(LeaseScope(app), loopback, origins, api_key, bound_host)

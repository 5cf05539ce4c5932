"""The ASGI app: the three dialects' routes behind the guard, plus the housekeeping
task that unloads idle models."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request

from . import llama_api, ollama_api, openai_api  # noqa: F401 - importing registers their routes
from .http import Guard, error_response
from .models import ModelManager
from .state import ROUTES, ServerState

REAP_INTERVAL_S = 1.0


def build_app(
    manager: ModelManager,
    loopback: bool = True,
    origins: list[str] | None = None,
    api_key: str | None = None,
    body_limit: int = 8 * 1024 * 1024,
    bound_host: str = "",
):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def reap_forever():
            while True:
                await asyncio.sleep(REAP_INTERVAL_S)
                await manager.reap()

        reaper = asyncio.create_task(reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            await manager.close()

    async def http_error(request: Request, exc: HTTPException):
        return error_response(request.url.path, exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")

    app = Starlette(routes=list(ROUTES), lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.localrun = ServerState(manager, body_limit)
    return Guard(app, loopback, origins, api_key, bound_host)

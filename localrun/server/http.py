"""HTTP plumbing shared by the dialects: the guard middleware (DNS-rebinding Host
check, CORS allowlist, cross-site simple requests, API key), bounded JSON bodies, each dialect's error shape, and
streaming that stops generating when the client goes away."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import BadRequestError, LocalrunError

LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "[::1]", "::1"}
# Sec-Fetch-Site values of a request another page made. "same-site" too: a page on
# another localhost port is same-site (ports do not count), and with --cors-origin not
# every local page is trusted; an allowed page's fetch() sends its Origin and passes.
CROSS_SITE = frozenset({"cross-site", "same-site"})
DEFAULT_ORIGINS = (
    r"https?://localhost(:\d+)?",
    r"https?://127\.0\.0\.1(:\d+)?",
    r"https?://\[::1\](:\d+)?",
    r"vscode-webview://.*",
    r"vscode-file://.*",
)


class PayloadTooLargeError(LocalrunError):
    http_status = 413


def dialect_of(path: str) -> str:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    if path.startswith("/api/"):
        return "ollama"
    return "llama"


# Anthropic's error types by status (what its SDKs map to exception classes)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def error_response(path: str, status: int, message: str) -> JSONResponse:
    """The error body each dialect's clients parse."""
    dialect = dialect_of(path)
    if dialect == "ollama":
        return JSONResponse({"error": message}, status_code=status)
    if dialect == "anthropic":
        return JSONResponse({"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                                        "message": message}}, status_code=status)
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "invalid_request_error", 503: "unavailable_error"}.get(status, "server_error")
    if dialect == "openai":
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)
    return JSONResponse({"error": {"code": status, "message": message, "type": kind}}, status_code=status)


class Guard:
    """ASGI middleware in front of every route.

    - Host check: a server on loopback answers only requests addressed to a loopback
      name, so a web page that rebinds its own DNS name to 127.0.0.1 gets 403.
    - CORS: browsers get Access-Control-Allow-Origin only for allowed origins (local
      pages and editor webviews by default); a request from any other origin gets 403.
    - Cross-site simple requests: a request a browser marks `Sec-Fetch-Site: cross-site`
      (or same-site) without an allowed Origin gets 403 on every route, so no page can
      load a model or run a generation through an <img>, <script> or <form>.
    - API key: with --api-key, every route but /health needs `Authorization: Bearer KEY`
      (or `x-api-key`).
    """

    def __init__(self, app, loopback: bool, origins: list[str] | None, api_key: str | None, bound: str = "") -> None:
        self.app = app
        self.loopback = loopback
        # the loopback names, and the address the server is bound to (127.0.0.2, ...)
        self.hosts = LOOPBACK_HOSTS | ({_host_name(bound)} if bound else set())
        patterns = [re.escape(o) for o in origins] if origins else list(DEFAULT_ORIGINS)
        self.origin_re = re.compile("^(" + "|".join(patterns) + ")$")
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        origin = headers.get("origin")
        cors = origin is not None and bool(self.origin_re.match(origin))
        if self.loopback and _host_name(headers.get("host", "")) not in self.hosts:
            return await error_response(path, 403, "forbidden host: this server answers only localhost names")(scope, receive, send)
        if origin is not None and not cors:
            # a page from another site: refuse outright, or a "simple" text/plain POST
            # (which a browser sends without asking first) would still run
            return await error_response(path, 403, f"forbidden origin {origin}: start the server with --cors-origin")(
                scope, receive, send
            )
        fetch_site = headers.get("sec-fetch-site")
        if fetch_site in CROSS_SITE and not cors:
            # a browser's "simple" request from another page that sends no Origin: an
            # <img src=http://127.0.0.1:11435/props> (which loads the default model), a
            # <form>, a link. A page's own fetch() to another origin always sends Origin,
            # so an allowed page is never refused here; a CLI or SDK sends no Sec-Fetch-Site.
            return await error_response(
                path, 403, f"forbidden {fetch_site} request from a web page that sent no allowed Origin:"
                " call this server from a script, or start it with --cors-origin for that page"
            )(scope, receive, send)
        if scope["method"] == "OPTIONS" and origin is not None:
            return await self._preflight(cors, origin, headers, scope, receive, send)
        if self.api_key and path != "/health" and not self._authorized(headers):
            resp = error_response(path, 401, "invalid or missing API key: send 'Authorization: Bearer KEY'")
            return await self._with_cors(resp, cors, origin)(scope, receive, send)

        async def send_with_cors(message) -> None:
            if cors and message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"vary", b"Origin"),
                ]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _authorized(self, headers: dict) -> bool:
        given = headers.get("authorization", "").removeprefix("Bearer ") or headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    @staticmethod
    def _with_cors(resp: Response, cors: bool, origin: str | None) -> Response:
        if cors and origin:
            resp.headers["access-control-allow-origin"] = origin
            resp.headers["vary"] = "Origin"
        return resp

    async def _preflight(self, cors, origin, headers, scope, receive, send) -> None:
        if not cors:
            return await Response(status_code=403)(scope, receive, send)
        resp = Response(status_code=204)
        resp.headers["access-control-allow-origin"] = origin
        resp.headers["access-control-allow-methods"] = "GET, POST, DELETE, OPTIONS"
        resp.headers["access-control-allow-headers"] = headers.get(
            "access-control-request-headers", "authorization, content-type"
        )
        resp.headers["access-control-max-age"] = "600"
        resp.headers["vary"] = "Origin"
        await resp(scope, receive, send)


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.index("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def read_json(request: Request, limit: int) -> dict:
    """The request's JSON object, read up to `limit` bytes (413 beyond)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"request body of {length} bytes exceeds the {limit}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(f"request body exceeds the {limit}-byte limit")
    if not body.strip():
        raise BadRequestError("the request body is empty: send a JSON object")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequestError("the request body nests too deeply") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:  # "\ud800" is valid JSON but no text: refuse it here, not deep in a tokenizer
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequestError("the request body holds an unpaired UTF-16 surrogate escape (e.g. \\ud800)") from None
    return data


async def _hang_up(request: Request) -> None:
    """Returns when the client disconnects. The body has been read, so the only message
    left to receive is the disconnect (polling `is_disconnected` misses it under uvicorn)."""
    message = await request.receive()
    while message["type"] != "http.disconnect":
        message = await request.receive()


class ClientDisconnected(asyncio.CancelledError):
    """The client hung up before its (non-streamed) answer was ready. A CancelledError, so
    code that lets cancellation through still does; `state.endpoint` turns it into one log
    line (an ASGI app that raises it would get a full traceback logged per hang-up)."""


async def until_done_or_disconnect(request: Request, work: Awaitable, on_disconnect: Callable[[], None]):
    """Await `work`; if the client hangs up first, call on_disconnect and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_hang_up(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        on_disconnect()
        raise ClientDisconnected("client disconnected")
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()


def stream(request: Request, chunks: AsyncIterator[bytes], media_type: str, on_close: Callable[[], None]) -> StreamingResponse:
    """A streamed body. on_close (which cancels the generation and frees its slot) runs
    when the stream ends or the client hangs up, even while nothing is being written:
    a request still queued or reading its prompt has no bytes to send that would fail."""

    async def watch() -> None:
        await _hang_up(request)
        on_close()

    async def guarded() -> AsyncIterator[bytes]:
        watcher = asyncio.ensure_future(watch())
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            watcher.cancel()
            on_close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(guarded(), media_type=media_type, headers=headers)


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def ndjson(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"

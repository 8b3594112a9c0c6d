"""The server's ASGI middleware: HTTP metrics, the API key, and the request-body size limit.

Plain ASGI (not Starlette's `BaseHTTPMiddleware`), so that streaming responses and the
client-disconnect signal pass through untouched. Order, outermost first: metrics (sees every
status, including the edge's own 401 / 413), API key, body limit. The body limit reads the
whole body (at most `max_bytes`) before the app runs and replays it; a larger body is read and
discarded up to `MAX_DISCARD_BYTES`, so the client sees the 413 rather than a reset.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from arborlm.server.errors import error_body
from arborlm.server.jsonresp import JSONResponse
from arborlm.server.limits import MAX_DISCARD_BYTES
from arborlm.server.metrics import ServerMetrics

OPEN_ROUTES = frozenset({"/health", "/metrics"})


async def _reply(scope: Scope, receive: Receive, send: Send, status: int, message: str,
                 headers: dict[str, str] | None = None) -> None:
    body = error_body(scope["path"], status, message)
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


class MetricsMiddleware:
    """Counts HTTP requests by route (unknown paths pooled as "other") and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: Iterable[str]):
        self.app = app
        self.metrics = metrics
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.http_requests.labels(route=route, status=str(status[0])).inc()


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but the open ones; 401 otherwise."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            await _reply(scope, receive, send, 401, "invalid or missing API key "
                         "(send 'Authorization: Bearer <key>')")
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads at most `max_bytes` of request body; answers 413 above that."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= MAX_DISCARD_BYTES:
                await _discard(receive, MAX_DISCARD_BYTES)
            await self._too_large(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _discard(receive, MAX_DISCARD_BYTES - size)
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _reply(scope, receive, send, 413,
                     f"the request body exceeds the server's limit of {self.max_bytes} bytes "
                     f"(--max-request-bytes)")


async def _discard(receive: Receive, budget: int) -> None:
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return

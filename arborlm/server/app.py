"""`create_app`: the FastAPI application over one engine client.

Wires the native and OpenAI routers, the ASGI middleware (metrics, API key, body limit), and
the exception handlers that give every error its API's body: pydantic validation errors and
the engine's `InvalidRequestError` -> 400 naming the field, `Overloaded` -> 503 with
`Retry-After`, an engine that is restarting -> 503 "engine restarting" with `Retry-After` (or
503 when it is dead for good), a vanished client -> 499 (nobody reads it; it only shows in the
metrics), any other failure -> 500, or 503 once the engine has died. The app does not start or
load the engine; `cli.py` does, and hands the client in. Shutting the app down shuts the client
down.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

import arborlm
from arborlm.errors import EngineDeadError, InvalidRequestError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.engine_client import EngineClient
from arborlm.server import native, openai_api
from arborlm.server.chat import ChatRenderer
from arborlm.server.errors import (
    ApiError,
    engine_unavailable,
    error_response,
    invalid_request,
    validation_error,
)
from arborlm.server.generation import ClientDisconnected, GenerationRunner
from arborlm.server.limits import RETRY_AFTER_S, AdmissionGate, Overloaded
from arborlm.server.metrics import ServerMetrics
from arborlm.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, MetricsMiddleware
from arborlm.server.server_args import ServerArgs
from arborlm.server.state import ServerState, server_state
from arborlm.server.tokens import TokenTexts

logger = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499


def create_app(client: EngineClient, server_args: ServerArgs,
               engine_args: EngineArgs) -> FastAPI:
    model_name = server_args.served_model_name or client.config.model.path
    metrics = ServerMetrics(model_name, engine_restarts=lambda: client.restarts)
    capacity = (engine_args.max_running_requests * server_args.dp_size
                + server_args.max_queued_requests)
    state = ServerState(
        client=client, server_args=server_args, engine_args=engine_args,
        runner=GenerationRunner(client, AdmissionGate(capacity), metrics), metrics=metrics,
        chat=ChatRenderer(client.tokenizer, server_args.chat_template),
        token_texts=TokenTexts(client.tokenizer), model_name=model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        logger.info("shutting down the engine")
        client.shutdown()

    app = FastAPI(title="ArborLM", version=arborlm.__version__, lifespan=lifespan)
    app.state.arbor = state
    app.include_router(native.router)
    app.include_router(openai_api.router)
    _add_exception_handlers(app)
    routes = [r.path for router in (native.router, openai_api.router) for r in router.routes]
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_args.max_request_bytes)
    if server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    return app


def _add_exception_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request.url.path, exc)

    async def invalid(request: Request, exc: InvalidRequestError) -> Response:
        path = request.url.path
        return error_response(path, invalid_request(path, exc.message, exc.param))

    async def pydantic_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request.url.path, validation_error(exc))

    async def overloaded(request: Request, exc: Overloaded) -> Response:
        err = ApiError(503, str(exc), code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
        return error_response(request.url.path, err)

    async def engine_down(request: Request, exc: EngineDeadError) -> Response:
        return error_response(request.url.path, engine_unavailable(exc))

    async def disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(request.url.path, ApiError(exc.status_code, detail,
                                                         headers=exc.headers))

    async def internal(request: Request, exc: Exception) -> Response:
        healthy = server_state(request).client.healthy()
        logger.error("request %s failed: %r", request.url.path, exc, exc_info=exc)
        status = 500 if healthy else 503
        message = f"internal error: {exc}" if healthy else f"the engine is not running: {exc}"
        return error_response(request.url.path, ApiError(status, message))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(InvalidRequestError, invalid)
    app.add_exception_handler(RequestValidationError, pydantic_error)
    app.add_exception_handler(Overloaded, overloaded)
    app.add_exception_handler(EngineDeadError, engine_down)
    app.add_exception_handler(ClientDisconnected, disconnected)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal)

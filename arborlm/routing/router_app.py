"""`create_router_app`: the router's HTTP front — SGLang's native and OpenAI's generation routes
proxied to `arborlm serve` workers, plus worker management.

Generation routes (`/generate`, `/v1/completions`, `/v1/chat/completions`) pick a worker with
the pool's policy from the request's text (`routing_text`) and relay the worker's answer as
is: status, body, and for `stream` requests the SSE stream chunk by chunk, with an
`X-ArborLM-Worker` header naming the worker. A request whose
worker cannot be reached, or drops the connection before its answer (or, streaming, before its
first chunk), or answers 503 (its engine is restarting or full), is sent to another worker, up
to `max_attempts` workers; the worker that failed to answer leaves rotation until its health
check passes. When no worker is left the answer is 503 naming each worker's failure. A worker
that dies in the middle of a stream cannot be retried (the client has part of the answer): the
stream ends with an SSE error event and `[DONE]`.

Control routes: `/health` (200 while a worker is in rotation), `/list_workers`,
`POST /add_worker?url=` and `POST /remove_worker?url=` (SGLang router's names),
`/get_server_info` (each worker's, with the router's view of it), `/flush_cache` (every
worker), and `/get_model_info` and `/v1/models` (from one worker). Bodies are not validated
here: the worker validates them and its 400 reaches the client unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from arborlm.routing.policy import ids_text
from arborlm.routing.workers import NoWorkerError, Worker, WorkerPool
from arborlm.server import sse
from arborlm.server.errors import ApiError, error_response
from arborlm.server.jsonresp import JSONResponse

logger = logging.getLogger("arborlm.router")
FORWARDED_REQUEST_HEADERS = ("content-type", "authorization")
FORWARDED_RESPONSE_HEADERS = ("content-type", "retry-after", "cache-control")
WORKER_HEADER = "x-arborlm-worker"  # names the worker that answered
RETRIED_STATUS = 503  # the worker ran nothing: its engine restarts or its queue is full


@dataclass(frozen=True)
class RouterOptions:
    max_attempts: int = 3  # workers a request is tried on
    health_check_interval: float = 10.0  # seconds between health checks of every worker


class _WorkerFailed(Exception):
    """The worker gave no answer (or a retryable 503); another may."""


def create_router_app(pool: WorkerPool, options: RouterOptions) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        checker = asyncio.create_task(_health_loop(pool, options.health_check_interval))
        yield
        checker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checker
        await pool.client.aclose()

    app = FastAPI(title="ArborLM router", lifespan=lifespan)

    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request.url.path, exc)

    app.add_exception_handler(ApiError, api_error)

    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, _proxy_route(pool, options, path), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        healthy = len(pool.in_rotation())
        if not healthy:
            raise ApiError(503, "no healthy worker")
        return JSONResponse({"healthy_workers": healthy})

    @app.get("/list_workers")
    async def list_workers() -> Response:
        return JSONResponse({"urls": list(pool.workers), "workers": [
            {"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight,
             "last_error": w.last_error} for w in pool.workers.values()]})

    @app.post("/add_worker")
    async def add_worker(url: str = "") -> Response:
        try:
            await pool.add(url)
        except ValueError as e:
            raise ApiError(400, str(e), param="url") from e
        return JSONResponse({"added": url, "urls": list(pool.workers)})

    @app.post("/remove_worker")
    async def remove_worker(url: str = "") -> Response:
        try:
            pool.remove(url)
        except ValueError as e:
            raise ApiError(400, str(e), param="url") from e
        return JSONResponse({"removed": url, "urls": list(pool.workers)})

    @app.get("/get_server_info")
    async def server_info() -> Response:
        infos = await _each_worker(pool, "GET", "/get_server_info")
        return JSONResponse({"workers": [
            {"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight, **info}
            for w, info in infos]})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        infos = await _each_worker(pool, "POST", "/flush_cache")
        ok = all(info.get("status") == 200 for _, info in infos)
        return JSONResponse({"workers": [{"url": w.url, **info} for w, info in infos]},
                            status_code=200 if ok else 503)

    for path in ("/get_model_info", "/v1/models"):
        app.add_api_route(path, _any_worker_route(pool, path), methods=["GET"])
    return app


async def _health_loop(pool: WorkerPool, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await pool.check_health()
        except Exception:  # noqa: BLE001 - keep checking
            logger.exception("health check failed")


def _proxy_route(pool: WorkerPool, options: RouterOptions, path: str):
    async def route(request: Request) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError as e:
            raise ApiError(400, f"the request body is not JSON: {e}") from e
        if not isinstance(payload, dict):
            raise ApiError(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in FORWARDED_REQUEST_HEADERS}
        return await _forward(pool, options, path, body, headers, routing_text(path, payload),
                              bool(payload.get("stream")))

    return route


async def _forward(pool: WorkerPool, options: RouterOptions, path: str, body: bytes,
                   headers: dict[str, str], text: str, stream: bool) -> Response:
    tried: set[str] = set()
    failures: list[str] = []
    while len(tried) < options.max_attempts:
        try:
            worker = pool.acquire(text, exclude=tried)
        except NoWorkerError as e:
            failures.append(str(e))
            break
        tried.add(worker.url)
        try:
            return await _send(pool, worker, path, body, headers, stream)
        except _WorkerFailed as e:
            failures.append(f"{worker.url}: {e}")
            logger.warning("%s: worker %s gave no answer (%s)", path, worker.url, e)
    raise ApiError(503, "no worker could answer the request: " + "; ".join(failures))


async def _send(pool: WorkerPool, worker: Worker, path: str, body: bytes,
                headers: dict[str, str], stream: bool) -> Response:
    """The worker's answer, relayed; `_WorkerFailed` when there is none to relay. The worker
    counts as in flight until its answer is relayed (a stream: until it ends)."""
    try:
        request = pool.client.build_request("POST", worker.url + path, content=body,
                                            headers=headers)
        response = await pool.client.send(request, stream=True)
    except httpx.HTTPError as e:
        pool.release(worker)
        pool.mark_failed(worker, f"{type(e).__name__}: {e}")
        raise _WorkerFailed(f"{type(e).__name__}: {e}") from e
    whole = not stream or response.status_code != 200  # errors are JSON, not a stream
    try:
        if response.status_code == RETRIED_STATUS:
            await response.aread()
            raise _WorkerFailed(f"answered 503: {response.text[:200]}")
        chunks = response.aiter_raw()
        first = await anext(chunks, b"")  # a worker that dies before answering can be retried
        if whole:
            first += b"".join([chunk async for chunk in chunks])
    except httpx.HTTPError as e:
        await response.aclose()
        pool.release(worker)
        pool.mark_failed(worker, f"{type(e).__name__}: {e}")
        raise _WorkerFailed(f"{type(e).__name__} before the answer: {e}") from e
    except BaseException:
        await response.aclose()
        pool.release(worker)
        raise
    if whole:
        await response.aclose()
        pool.release(worker)
        return Response(first, status_code=response.status_code,
                        headers={**_response_headers(response), WORKER_HEADER: worker.url})
    relayed = sse.SSEResponse(_relay(pool, worker, response, first, chunks))
    relayed.headers[WORKER_HEADER] = worker.url
    return relayed


async def _relay(pool: WorkerPool, worker: Worker, response: httpx.Response, first: bytes,
                 chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in chunks:
            yield chunk
    except httpx.HTTPError as e:
        pool.mark_failed(worker, f"{type(e).__name__}: {e}")
        yield sse.error_event(f"worker {worker.url} failed during the stream: "
                              f"{type(e).__name__}: {e}", 503)
        yield sse.DONE
    finally:
        await response.aclose()
        pool.release(worker)


def _response_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items()
            if k.lower() in FORWARDED_RESPONSE_HEADERS}


def _any_worker_route(pool: WorkerPool, path: str):
    async def route() -> Response:
        for worker in pool.in_rotation():
            try:
                response = await pool.client.get(worker.url + path)
            except httpx.HTTPError as e:
                pool.mark_failed(worker, f"{type(e).__name__}: {e}")
                continue
            return Response(response.content, status_code=response.status_code,
                            headers=_response_headers(response))
        raise ApiError(503, "no healthy worker")

    return route


async def _each_worker(pool: WorkerPool, method: str, path: str
                       ) -> list[tuple[Worker, dict[str, Any]]]:
    """`path` on every worker at once: (worker, {"status", its JSON or "error"})."""
    async def one(worker: Worker) -> dict[str, Any]:
        try:
            response = await pool.client.request(method, worker.url + path,
                                                 timeout=pool.health_check_timeout)
        except httpx.HTTPError as e:
            return {"status": None, "error": f"{type(e).__name__}: {e}"}
        try:
            return {"status": response.status_code, "info": response.json()}
        except ValueError:
            return {"status": response.status_code, "error": response.text[:200]}

    workers = list(pool.workers.values())
    return list(zip(workers, await asyncio.gather(*(one(w) for w in workers))))


def routing_text(path: str, payload: dict[str, Any]) -> str:
    """The text a request is routed on: its prompt (first prompt of a batch), chat messages'
    contents joined, or its token ids as characters (`ids_text`); '' when it has none."""
    if path == "/v1/chat/completions":
        return "\n".join(_content_text(m.get("content")) for m in payload.get("messages") or []
                         if isinstance(m, dict))
    prompt = payload.get("text") if path == "/generate" else payload.get("prompt")
    if prompt is None and path == "/generate":
        prompt = payload.get("input_ids")
    while isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch: the first prompt stands for it
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(i, int) and i >= 0 for i in prompt):
        return ids_text(prompt)
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""

"""`GenerationRunner`: how every HTTP route runs a `GenerateRequest` on the engine.

One path for the native and the OpenAI routes: validate the request (engine checks plus the
server's `max_new_tokens` limit), take its sequences' slots at the admission gate (or raise
`Overloaded`), stream events from the engine client, feed the metrics, and give the slots back
however the request ends. The engine is always asked to stream, so time-to-first-token and
inter-token latency are measured for every request; an engine that dies (or is restarting)
fails the request with a 503 `ApiError` (see `errors.engine_unavailable`), mid-stream too.
`collect_finals` folds a stream back into the final native objects (its logprob lists
concatenated). A sequence the engine aborts with
an error status (not the client's own abort) fails the request with that status.
`race_disconnect` runs an awaitable until it finishes or the HTTP client goes away — in which
case the awaitable is cancelled, and closing the engine iterator aborts the request in the
engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, suppress
from typing import Any, TypeVar

from starlette.requests import Request

from arborlm.errors import EngineDeadError, InvalidRequestError
from arborlm.runtime.engine_client import EngineClient
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.server.errors import ApiError, engine_unavailable
from arborlm.server.limits import AdmissionGate, check_max_new_tokens
from arborlm.server.metrics import ServerMetrics

T = TypeVar("T")
Event = tuple[int, dict[str, Any]]


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


class GenerationRunner:
    def __init__(self, client: EngineClient, gate: AdmissionGate, metrics: ServerMetrics):
        self.client = client
        self.gate = gate
        self.metrics = metrics
        self.context_length = client.config.model.context_length
        self.user_rids: dict[str, int] = {}  # user-given engine rids in flight -> refcount

    def check(self, req: GenerateRequest, max_tokens_param: str = "max_new_tokens") -> list[str]:
        """Validate what can be checked before tokenizing; the engine rids of the sequences."""
        singles = req.normalize()
        for single in singles:
            check_max_new_tokens(single.sampling_params.max_new_tokens, self.context_length,
                                 max_tokens_param)
        return [s.rid for s in singles]

    async def events(self, req: GenerateRequest,
                     max_tokens_param: str = "max_new_tokens") -> AsyncIterator[Event]:
        """(sequence index, native event) of every sequence, streaming chunks included."""
        rids = self.check(req, max_tokens_param)
        n = len(rids)
        self.gate.admit(n)
        self.metrics.in_flight.inc(n)
        tracked = rids if req.rid is not None else []
        for rid in tracked:
            self.user_rids[rid] = self.user_rids.get(rid, 0) + 1
        observer = self.metrics.observer()
        try:
            stream = dataclasses.replace(req, stream=True)
            async with aclosing(self.client.generate(stream)) as engine_events:
                async for index, event in engine_events:
                    observer.event(index, event)
                    _raise_if_failed(event)
                    yield index, event
        except EngineDeadError as e:  # died (and maybe restarting) before or while it ran
            raise engine_unavailable(e) from e
        finally:
            observer.close(n)
            self.gate.release(n)
            self.metrics.in_flight.dec(n)
            for rid in tracked:
                self.user_rids[rid] -= 1
                if not self.user_rids[rid]:
                    del self.user_rids[rid]

    def abort(self, rid: str | None, abort_all: bool = False) -> None:
        """Abort a request id — and its `n > 1` sequences `rid-0`, `rid-1`, ... — or all."""
        if abort_all:
            self.client.abort(None, abort_all=True)
            return
        assert rid is not None
        prefix = rid + "-"
        children = [r for r in self.user_rids
                    if r.startswith(prefix) and r[len(prefix):].isdigit()]
        for target in [rid, *children]:
            self.client.abort(target)


# An abort the client asked for (or caused by leaving); any other abort is a failed request.
CLIENT_ABORT_STATUS = 499


def _raise_if_failed(event: dict[str, Any]) -> None:
    """A sequence the engine ended with an error (invalid grammar, KV pool too small, a
    failure in a child process) fails the whole request, with the engine's status."""
    reason = event["meta_info"].get("finish_reason") or {}
    status = reason.get("status_code")
    if reason.get("type") != "abort" or status in (None, CLIENT_ABORT_STATUS):
        return
    message = reason.get("message") or "the request failed"
    if status == 400:
        raise InvalidRequestError(message)
    raise ApiError(status, message)


async def collect_finals(events: AsyncIterator[Event]) -> list[dict[str, Any]]:
    """Final events in index order, each with the logprob entries of all its chunks."""
    lists: dict[int, dict[str, list]] = {}
    finals: dict[int, dict[str, Any]] = {}
    async with aclosing(events):
        async for index, event in events:
            meta = event["meta_info"]
            acc = lists.setdefault(index, {})
            for key, value in meta.items():
                if key.endswith("logprobs") and isinstance(value, list):
                    acc.setdefault(key, []).extend(value)
            if meta.get("finish_reason") is not None:
                finals[index] = {**event, "meta_info": {**meta, **acc}}
    return [finals[i] for i in sorted(finals)]


async def race_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`; if the client disconnects first, cancel it and raise
    `ClientDisconnected`."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            with suppress(asyncio.CancelledError):
                await work
        watcher.cancel()
        with suppress(asyncio.CancelledError):
            await watcher
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def started(request: Request, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first item of `events` (so that validation and admission errors surface
    before a response starts); return an iterator over all of it that closes `events`."""
    try:
        first = await race_disconnect(request, anext(events))
    except StopAsyncIteration:
        first = None
        done = True
    else:
        done = False

    async def chained() -> AsyncIterator[T]:
        async with aclosing(events):
            if done:
                return
            yield first
            async for item in events:
                yield item

    return chained()

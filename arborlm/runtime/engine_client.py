"""`EngineClient`: what the API side (Engine, HTTP server, DSL) talks to.

Two implementations share this interface: `InProcessClient` (below: the scheduler runs in a
background thread of this process) and the multi-process client (tokenizer manager in this
process; scheduler and detokenizer in child processes over ZeroMQ). Callers never touch the
scheduler directly.

Events are the native API's JSON objects (`text`, `output_ids`, `meta_info`). With
`stream=True` each sequence yields chunks (cumulative `text`, new logprob entries only,
`finish_reason` null) and then a final event; without it, only the final event. A sequence is
identified by its index in the normalized request (batch prompts × n).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator
from typing import Any

from arborlm.errors import EngineDeadError
from arborlm.runtime.config import EngineConfig
from arborlm.runtime.generate_request import GenerateRequest


class EngineClient(abc.ABC):
    tokenizer: Any
    config: EngineConfig
    restarts: int = 0  # times the engine was started again after it died

    @property
    @abc.abstractmethod
    def max_total_tokens(self) -> int:
        """KV pool capacity in tokens."""

    @abc.abstractmethod
    def generate(self, req: GenerateRequest) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Async iterator of (sequence index, event). Raises `InvalidRequestError` before the
        first event for bad input. Closing the iterator early aborts the unfinished sequences."""

    @abc.abstractmethod
    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request id (or all); its waiters get a final `abort` event."""

    @abc.abstractmethod
    async def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache; (False, reason) while requests are pending."""

    @abc.abstractmethod
    async def server_info(self) -> dict[str, Any]:
        """Live scheduler figures (queue sizes, cache hit rate, KV capacity, ...)."""

    @abc.abstractmethod
    def healthy(self) -> bool:
        """False once a component has died."""

    def check_available(self) -> None:
        """Raise `EngineRestartingError` while the engine is being started again, or
        `EngineDeadError` when it is not running; return when it serves."""
        if not self.healthy():
            raise EngineDeadError("the engine is not running")

    def pids(self) -> dict[str, int]:
        """Process ids of the engine's child processes by name (none in-process)."""
        return {}

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop everything this client started; idempotent."""

    async def generate_all(self, req: GenerateRequest) -> list[dict[str, Any]]:
        """Final events of every sequence, in index order."""
        finals: dict[int, dict[str, Any]] = {}
        async for index, event in self.generate(req):
            if event["meta_info"].get("finish_reason") is not None:
                finals[index] = event
        return [finals[i] for i in sorted(finals)]

    def generate_sync(self, req: GenerateRequest) -> list[dict[str, Any]]:
        """Blocking `generate_all` for callers without an event loop (any thread)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.generate_all(req))
        raise RuntimeError("generate_sync called inside a running event loop; "
                           "use `await engine.async_generate(...)` instead")

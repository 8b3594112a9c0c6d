"""`WorkerPool`: the router's workers — their URLs, health, requests in flight, and the policy.

A worker is in rotation while it is healthy. It leaves rotation when a request to it fails to
connect or its connection drops before the answer (`mark_failed`), or when its `/health` check
fails `HEALTH_FAILURE_THRESHOLD` times in a row (one slow answer on a busy machine is not a
death); the health loop (`check_health`, run every `health_check_interval` seconds by the router)
puts it back once `/health` answers 200 again. `remove` takes a worker out for good (its
requests in flight still finish); `add` registers one after a successful `/health`.

`acquire(text)` picks a worker in rotation with the policy and counts the request as in flight
until its `release`; `exclude` leaves out workers a retry has already tried. The pool lives on
the router's event loop (no locks); it does not send requests itself, only health checks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from arborlm.routing.policy import RoutingPolicy

logger = logging.getLogger("arborlm.router")
HEALTH_FAILURE_THRESHOLD = 3


@dataclass
class Worker:
    url: str
    healthy: bool = True
    in_flight: int = 0
    last_error: str = ""
    failed_checks: int = 0  # consecutive failed health checks


class NoWorkerError(Exception):
    """No worker in rotation (every one is dead, removed, or already tried)."""


def normalize_url(url: str) -> str:
    """`url` without a trailing slash, checked to be an http(s) URL with a host."""
    url = url.strip().rstrip("/")
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"a worker URL must look like http://host:port, got {url!r}")
    return url


class WorkerPool:
    def __init__(self, urls: list[str], policy: RoutingPolicy, client: httpx.AsyncClient,
                 health_check_timeout: float):
        self.policy = policy
        self.client = client
        self.health_check_timeout = health_check_timeout
        self.workers: dict[str, Worker] = {}
        for url in urls:
            url = normalize_url(url)
            self.workers[url] = Worker(url)

    def in_rotation(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def acquire(self, text: str, exclude: set[str] = frozenset()) -> Worker:
        """A worker for a request with `text`, counted in flight until `release`."""
        loads = {w.url: w.in_flight for w in self.in_rotation() if w.url not in exclude}
        if not loads:
            raise NoWorkerError(self._none_left_message(exclude))
        worker = self.workers[self.policy.choose(text, loads)]
        worker.in_flight += 1
        return worker

    def release(self, worker: Worker) -> None:
        worker.in_flight -= 1
        assert worker.in_flight >= 0

    def mark_failed(self, worker: Worker, error: str) -> None:
        """Take `worker` out of rotation until a health check passes."""
        if worker.healthy:
            logger.warning("worker %s out of rotation: %s", worker.url, error)
        worker.healthy = False
        worker.last_error = error
        self.policy.remove_worker(worker.url)

    async def add(self, url: str) -> Worker:
        """Register `url` after its `/health` answers 200 (raises ValueError otherwise)."""
        url = normalize_url(url)
        if url in self.workers:
            raise ValueError(f"worker {url} is already registered")
        error = await self._health_error(url)
        if error:
            raise ValueError(f"worker {url} is not healthy: {error}")
        worker = self.workers[url] = Worker(url)
        logger.info("worker %s added", url)
        return worker

    def remove(self, url: str) -> None:
        url = normalize_url(url)
        if self.workers.pop(url, None) is None:
            raise ValueError(f"worker {url} is not registered")
        self.policy.remove_worker(url)
        logger.info("worker %s removed", url)

    async def check_health(self) -> None:
        """Check every worker's `/health` at once; move each in or out of rotation."""
        workers = list(self.workers.values())
        errors = await asyncio.gather(*(self._health_error(w.url) for w in workers))
        for worker, error in zip(workers, errors):
            worker.failed_checks = worker.failed_checks + 1 if error else 0
            if error and worker.failed_checks >= HEALTH_FAILURE_THRESHOLD:
                self.mark_failed(worker, error)
            elif not error and not worker.healthy and worker.url in self.workers:
                logger.info("worker %s back in rotation", worker.url)
                worker.healthy, worker.last_error = True, ""

    async def _health_error(self, url: str) -> str:
        """'' when `url`/health answers 200, else why not."""
        try:
            response = await self.client.get(url + "/health", timeout=self.health_check_timeout)
        except httpx.HTTPError as e:
            return f"/health failed: {type(e).__name__}: {e}"
        return "" if response.status_code == 200 else f"/health answered {response.status_code}"

    def _none_left_message(self, exclude: set[str]) -> str:
        if not self.workers:
            return "no worker is registered (add one with POST /add_worker?url=...)"
        down = [f"{w.url} ({w.last_error or 'tried'})" for w in self.workers.values()
                if not w.healthy or w.url in exclude]
        return "no healthy worker left: " + "; ".join(down)

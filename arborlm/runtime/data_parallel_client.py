"""`DataParallelClient`: N engine replicas behind one client, each request routed by a policy.

```
API process:  DataParallelClient ── policy (routing/policy.py)
                    │
              TokenizerManager ──▶ replica 0: scheduler ──▶ detokenizer ──┐
                 ▲  (one)      ──▶ replica 1: scheduler ──▶ detokenizer ──┤
                 └────────────────────────────────────────────────────────┘
```

One tokenizer manager (one tokenizer, one receiving socket and thread, one table of requests in
flight, one stream of per-request seeds) fronts N replicas, as SGLang's data-parallel
controller does. Each replica is a `MultiProcessClient` sharing that manager: its scheduler and
detokenizer processes, its own KV pool and radix cache, its own restart policy (a replica's
detokenizer stays with its scheduler, so a replica dies and restarts as a unit). A request is
tokenized and validated once (every replica has the same model, tokenizer and limits), then
routed with its first sequence's token ids as the routing text (`ids_text`), so the cache-aware
policy matches token prefixes; all sequences of one request go to one replica. The policy sees
the replicas in rotation — those whose processes are alive and not restarting — and each one's
requests in flight.

A replica whose process dies fails its own in-flight requests ("engine restarting: scheduler
process died ...") and leaves rotation while it restarts; the others keep serving. The client
reports itself dead (and calls `on_fatal`) only when every replica is dead for good.
`server_info` sums the replicas' counters and lists each replica's own figures under
`replicas` (with `dp_rank`). This module imports no model or scheduler code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from arborlm.errors import EngineDeadError
from arborlm.routing.policy import RoutingPolicy, ids_text
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.engine_client import EngineClient
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.runtime.ipc import IpcAddresses
from arborlm.runtime.multiprocess_client import MultiProcessClient, RestartPolicy
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.runtime.tokenizer_utils import load_tokenizer

# Counters of a replica's `server_info` that add up across replicas.
SUMMED = ("num_running_reqs", "num_waiting_reqs", "max_total_num_tokens", "available_kv_tokens",
          "cached_kv_tokens", "prefill_tokens", "cached_tokens")


class DataParallelClient(EngineClient):
    def __init__(self, args: EngineArgs, dp_size: int, policy: RoutingPolicy,
                 restart: RestartPolicy | None = None,
                 on_fatal: Callable[[str], None] | None = None):
        if dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, got {dp_size}")
        self.policy = policy
        self.on_fatal = on_fatal
        self._lock = threading.Lock()  # the policy and the in-flight counts
        self._fatal: dict[int, str] = {}
        self._in_flight = [0] * dp_size
        # Resolve (build or fetch the model) and load the tokenizer once, here: the replicas
        # then start side by side without racing on either.
        self.config = config = args.resolve()
        args = dataclasses.replace(args, model_path=config.model.path,
                                   tokenizer_path=config.tokenizer_path)
        self._home = IpcAddresses.create()
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        self.tm = TokenizerManager(config, self.tokenizer, self._home.detokenizer_to_tokenizer,
                                   args.random_seed)
        with ThreadPoolExecutor(dp_size) as pool:
            starts = [pool.submit(MultiProcessClient, args, restart,
                                  lambda reason, rank=rank: self._replica_fatal(rank, reason),
                                  (rank, self.tm, self._home))
                      for rank in range(dp_size)]
        replicas = []
        for start in starts:
            try:
                replicas.append(start.result())
            except BaseException:
                for started in [s.result() for s in starts if s.exception() is None]:
                    started.shutdown()
                self._close(EngineDeadError("the engine failed to start"))
                raise
        self.replicas: list[MultiProcessClient] = replicas

    @property
    def restarts(self) -> int:  # type: ignore[override]
        return sum(r.restarts for r in self.replicas)

    @property
    def max_total_tokens(self) -> int:
        """One replica's KV capacity (a request runs on one replica)."""
        return self.replicas[0].max_total_tokens

    def pids(self) -> dict[str, int]:
        return {f"{name}-{rank}": pid for rank, r in enumerate(self.replicas)
                for name, pid in r.pids().items()}

    # --- EngineClient -------------------------------------------------------------------------

    def generate(self, req: GenerateRequest) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        self.check_available()
        prepared = self.tm.prepare(req)  # raises on bad input, before routing
        text = ids_text(prepared[0][1]) if prepared else ""
        rank = self._acquire(text)
        try:
            self.replicas[rank].check_available()
            events = self.tm.generate_prepared(prepared, rank)
        except BaseException:
            self._release(rank)
            raise
        return self._counted(rank, events)

    async def _counted(self, rank: int, events: AsyncIterator[tuple[int, dict[str, Any]]]
                       ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        try:
            async for item in events:
                yield item
        finally:
            self._release(rank)
            await events.aclose()  # type: ignore[attr-defined]

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.check_available()
        self.tm.abort(rid, abort_all)  # to every replica serving; one not running rid ignores it

    async def flush_cache(self) -> tuple[bool, str]:
        results = await asyncio.gather(*(r.flush_cache() for r in self._serving()))
        failed = [f"replica {i}: {msg}" for i, (ok, msg) in enumerate(results) if not ok]
        return (not failed, "; ".join(failed) or "flushed every replica's cache")

    async def server_info(self) -> dict[str, Any]:
        ranks = [rank for rank, r in enumerate(self.replicas) if r.healthy()]
        infos = await asyncio.gather(*(self.replicas[rank].server_info() for rank in ranks))
        replicas = [{"dp_rank": rank, "in_flight": self._in_flight[rank], **info}
                    for rank, info in zip(ranks, infos)]
        total = {**infos[0]} if infos else {}
        for key in SUMMED:
            total[key] = sum(info.get(key, 0) for info in infos)
        prompt = total.get("prefill_tokens", 0) + total.get("cached_tokens", 0)
        total["cache_hit_rate"] = total.get("cached_tokens", 0) / prompt if prompt else 0.0
        total.pop("scheduler_pid", None)
        return {**total, "dp_size": len(self.replicas), "replicas_serving": len(ranks),
                "replicas": replicas}

    def healthy(self) -> bool:
        return any(r.healthy() for r in self.replicas)

    def check_available(self) -> None:
        if any(r.healthy() for r in self.replicas):
            return
        self.replicas[0].check_available()  # the restarting / dead error of a replica
        raise EngineDeadError("no engine replica is serving")

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()
        self._close(EngineDeadError("the engine has been shut down"))

    def _close(self, error: EngineDeadError) -> None:
        self.tm.close(error)
        self._home.cleanup()

    # --- routing ------------------------------------------------------------------------------

    def _serving(self) -> list[MultiProcessClient]:
        return [r for r in self.replicas if r.healthy()]

    def _acquire(self, text: str) -> int:
        with self._lock:
            loads = {str(rank): self._in_flight[rank] for rank, r in enumerate(self.replicas)
                     if r.healthy()}
            if not loads:
                raise EngineDeadError("no engine replica is serving")
            rank = int(self.policy.choose(text, loads))
            self._in_flight[rank] += 1
            return rank

    def _release(self, rank: int) -> None:
        with self._lock:
            self._in_flight[rank] -= 1

    def _replica_fatal(self, rank: int, reason: str) -> None:
        """Replica `rank` could not be restarted; the client dies with the last one."""
        with self._lock:
            self.policy.remove_worker(str(rank))
            self._fatal[rank] = reason
            all_dead = len(self._fatal) == len(self._in_flight)
        if all_dead and self.on_fatal is not None:
            self.on_fatal(f"every engine replica is dead (replica {rank}: {reason})")

"""`MultiProcessClient`: the engine as processes — the server's setup behind `Engine`.

```
this process:  Engine → MultiProcessClient → TokenizerManager ──ipc──▶ scheduler process
                                                   ▲                          │
                                                   └──ipc── detokenizer ◀─────┘
```

The constructor resolves the configuration (building or fetching the model) and starts the
engine's processes (`_Processes`): a private socket directory (`IpcAddresses`), the scheduler
process (which compiles the kernels and loads the model) and the detokenizer process; the
tokenizer manager (which outlives restarts) binds its socket in the parent directory and loads
the tokenizer while the first children start. It waits for both children to report ready,
logging their startup phases, then connects the tokenizer manager to the scheduler. As one
replica of `DataParallelClient` (`rank`, `tm`), it shares that client's tokenizer manager:
its processes come and go as a replica's while the manager serves the others. A child that fails
to start makes the constructor raise the child's error (the same `arborlm.errors` class where
it raised one). The scheduler's KV capacity arrives with its ready message.

Liveness: a watchdog thread waits on the children's process sentinels, so a death is seen at
once. What follows depends on the `RestartPolicy`:

- None (the library's default): the engine turns unhealthy for good, every pending call fails
  with `EngineDeadError("scheduler process died (exit code -9)")`-style errors, later calls raise
  it at once, and the surviving child is stopped.
- a policy (the server's): pending calls fail with `EngineRestartingError("engine restarting:
  scheduler process died ...")`, new calls raise it at once, both children are stopped, and
  fresh ones start on fresh socket addresses — after `backoff_s`, doubling after each failed
  start up to `max_backoff_s`. A start that succeeds makes the engine serve again (and counts
  in `restarts`); after `attempts` consecutive failed starts the engine is dead for good and
  `on_fatal(reason)` runs (the server then exits non-zero).

`shutdown()` (also run at interpreter exit and on SIGTERM, see `process_utils`) sends a
`ShutdownReq` through the pipeline, waits for the children, escalates to SIGTERM / SIGKILL, and
removes the socket directory; it also cancels a restart in progress. Children stop by
themselves if this process dies.

Caveat of the "spawn" start method: a script that creates a multi-process engine at import time
must guard it with `if __name__ == "__main__":`, since the children import the main module.
This module imports no model or scheduler code.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

from arborlm.errors import EngineDeadError, EngineRestartingError
from arborlm.runtime import startup
from arborlm.runtime.config import EngineArgs, EngineConfig
from arborlm.runtime.engine_client import EngineClient
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.runtime.ipc import IpcAddresses
from arborlm.runtime.messages import ShutdownReq
from arborlm.runtime.process_utils import (
    ChildProcess,
    register_for_cleanup,
    spawn_child,
    unregister,
    wait_ready,
)
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.runtime.tokenizer_utils import load_tokenizer

logger = logging.getLogger(__name__)

SCHEDULER_ENTRY = "arborlm.runtime.scheduler_process:SchedulerService"
DETOKENIZER_ENTRY = "arborlm.runtime.detokenizer_process:DetokenizerService"
STARTUP_TIMEOUT_S = 600.0
WATCH_INTERVAL_S = 0.5  # the watchdog rechecks its stop flag this often
SHUTDOWN_TIMEOUT_S = 5.0  # how long children get to exit after a ShutdownReq


def scheduler_env() -> dict[str, str]:
    """Environment of the scheduler process. OpenMP threads that spin while waiting (the
    default) starve the detokenizer and this process of CPU on a small machine and slow every
    step of a CPU scheduler many times over; passive waiting avoids it. ArborLM's own kernels,
    a decode step's every parallel region, do not use OpenMP but their own pool
    (`csrc/thread_pool.cpp`), which spins only while the machine has cores to spare; this
    setting is for torch's operators (prefill's GEMMs). A value the user set is kept."""
    return {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead engine is replaced: up to `attempts` consecutive failed starts (0: none),
    the k-th after `min(backoff_s * 2**k, max_backoff_s)` seconds."""

    attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before start `attempt` (0-based) of a restart."""
        return min(self.backoff_s * 2 ** attempt, self.max_backoff_s)


class _Processes:
    """One start of replica `rank`: its socket directory (inside `home`, whose detokenizer
    address is the tokenizer manager's), its two children, its link from the manager."""

    def __init__(self, config: EngineConfig, args: EngineArgs, home: IpcAddresses, rank: int,
                 tm: Callable[[], TokenizerManager], cancel: threading.Event | None = None):
        self.addrs = dataclasses.replace(IpcAddresses.create(home.run_dir),
                                         detokenizer_to_tokenizer=home.detokenizer_to_tokenizer)
        self.rank = rank
        self.children: list[ChildProcess] = []
        self.tm: TokenizerManager | None = None
        self.max_total_tokens = 0
        self._stopped = False
        try:
            self.children = [
                spawn_child("scheduler", SCHEDULER_ENTRY, args, self.addrs,
                            cleanup_dir=home.run_dir, env=scheduler_env()),
                spawn_child("detokenizer", DETOKENIZER_ENTRY, config.tokenizer_path,
                            self.addrs, rank, cleanup_dir=home.run_dir),
            ]
            self.tm = tm()  # the children start meanwhile (the first time: the tokenizer loads)
            infos = wait_ready(self.children, STARTUP_TIMEOUT_S, cancel)
        except BaseException:
            self.stop(EngineDeadError("the engine failed to start"), graceful=False)
            raise
        self.max_total_tokens = infos["scheduler"]["max_total_tokens"]
        self.tm.connect(rank, self.addrs.tokenizer_to_scheduler, self.max_total_tokens)
        logger.info("engine processes%s: %s", f" of replica {rank}" if rank else "",
                    ", ".join(f"{c.name} pid {c.pid}" for c in self.children))

    def dead_child(self) -> ChildProcess | None:
        return next((c for c in self.children if not c.is_alive()), None)

    def stop(self, error: EngineDeadError, graceful: bool) -> None:
        """Fail this replica's pending calls with `error`, stop the children, remove the
        sockets (once)."""
        if self._stopped:
            return
        self._stopped = True
        link = None if self.tm is None else self.tm.disconnect(self.rank, error)
        if link is not None and graceful and all(c.is_alive() for c in self.children):
            link.put(ShutdownReq())  # travels on to the detokenizer; both exit
        for child in self.children:
            child.stop(SHUTDOWN_TIMEOUT_S if graceful else 0.0)
        if link is not None:
            link.close()
        self.addrs.cleanup()


class MultiProcessClient(EngineClient):
    def __init__(self, args: EngineArgs, restart: RestartPolicy | None = None,
                 on_fatal: Callable[[str], None] | None = None,
                 replica: tuple[int, TokenizerManager, IpcAddresses] | None = None):
        """`replica`: (rank, the shared tokenizer manager, the socket directory it binds in)
        when this engine is one replica of a `DataParallelClient`; else it has its own."""
        startup.phase("building or fetching the model")
        self.config = args.resolve()
        # Children get the resolved paths, so they need not resolve defaults again.
        self.args = dataclasses.replace(args, model_path=self.config.model.path,
                                        tokenizer_path=self.config.tokenizer_path)
        self.restart_policy = restart
        self.on_fatal = on_fatal
        self.restarts = 0  # engines started again after a death
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._error: EngineDeadError | None = None  # set while not serving
        self._closed = False
        self.rank, self._tm, self._home = replica or (0, None, IpcAddresses.create())
        self._owns_tm = replica is None
        startup.phase("starting the engine processes")
        started = time.monotonic()
        try:
            self._procs = _Processes(self.config, self.args, self._home, self.rank,
                                     self._manager)
        except BaseException:
            self._close_manager(EngineDeadError("the engine failed to start"))
            raise
        self._start_s = time.monotonic() - started
        logger.info("engine started in %.1f s", self._start_s)
        self._watchdog = threading.Thread(target=self._watch, name="arborlm-watchdog",
                                          daemon=True)
        self._watchdog.start()
        register_for_cleanup(self)

    def _manager(self) -> TokenizerManager:
        """The tokenizer manager, made (and the tokenizer loaded) on the first start."""
        if self._tm is None:
            self._tm = TokenizerManager(self.config, load_tokenizer(self.config.tokenizer_path),
                                        self._home.detokenizer_to_tokenizer,
                                        self.args.random_seed)
        return self._tm

    def _close_manager(self, error: EngineDeadError) -> None:
        """Close the tokenizer manager and the socket directory, when this engine owns them."""
        if not self._owns_tm:
            return
        if self._tm is not None:
            self._tm.close(error)
        self._home.cleanup()

    @property
    def tokenizer(self) -> Any:
        return self._manager().tokenizer

    @property
    def tm(self) -> TokenizerManager:
        """The tokenizer manager, while this engine serves (raises why it does not)."""
        with self._lock:
            if self._error is not None:
                raise _copy(self._error)
            return self._manager()

    @property
    def children(self) -> list[ChildProcess]:
        return self._procs.children

    @property
    def addrs(self) -> IpcAddresses:
        return self._procs.addrs

    @property
    def max_total_tokens(self) -> int:
        return self._procs.max_total_tokens

    def pids(self) -> dict[str, int]:
        """Process ids of the children, by name ("scheduler", "detokenizer")."""
        return {c.name: c.pid for c in self.children}

    # --- EngineClient -------------------------------------------------------------------------

    def generate(self, req: GenerateRequest) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        return self.tm.generate(req, self.rank)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.tm.abort(rid, abort_all, [self.rank])

    async def flush_cache(self) -> tuple[bool, str]:
        return await self.tm.flush_cache(self.rank)

    async def server_info(self) -> dict[str, Any]:
        return await self.tm.server_info(self.rank)

    async def health_check(self) -> bool:
        """True after a round trip through both children."""
        return await self.tm.health_check(self.rank)

    def healthy(self) -> bool:
        with self._lock:
            return self._error is None and self._procs.dead_child() is None

    def check_available(self) -> None:
        with self._lock:
            if self._error is not None:
                raise _copy(self._error)
            dead = self._procs.dead_child()
        if dead is not None:  # the watchdog is about to act on it
            policy = self.restart_policy
            raise self._restarting_error(dead.death_message()) if policy and policy.attempts \
                else EngineDeadError(dead.death_message())

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            was_serving = self._error is None
            self._error = EngineDeadError("the engine has been shut down")
        self._closing.set()
        if self._watchdog is not threading.current_thread():
            self._watchdog.join()  # it stops a start in progress (cancelled by _closing)
        self._procs.stop(self._error, graceful=was_serving)
        self._close_manager(self._error)
        unregister(self)

    # --- lifecycle ----------------------------------------------------------------------------

    def _restarting_error(self, reason: str) -> EngineRestartingError:
        retry = max(1, math.ceil(self._start_s))
        return EngineRestartingError(f"engine restarting: {reason}", retry_after_s=retry)

    def _watch(self) -> None:
        while not self._closing.is_set():
            sentinels = [c.process.sentinel for c in self._procs.children]
            wait_for_sentinels(sentinels, timeout=WATCH_INTERVAL_S)
            dead = self._procs.dead_child()
            if dead is None or self._closing.is_set():
                continue
            died = time.monotonic()
            reason = dead.death_message()
            tail = dead.output.text(wait_s=1.0)
            logger.error("%s; failing every pending request%s", reason,
                         f"; its last output:\n{tail}" if tail else "")
            if not self._replace(reason, died):
                return

    def _replace(self, reason: str, died: float) -> bool:
        """Stop the dead engine's processes and start new ones; False when it stays dead."""
        policy = self.restart_policy
        error = self._restarting_error(reason) if policy and policy.attempts else \
            EngineDeadError(reason)
        with self._lock:
            if self._closed:
                return False
            self._error = error
        self._procs.stop(error, graceful=False)
        if isinstance(error, EngineRestartingError) and self._start_again(reason, died):
            return True
        if self._closing.is_set():
            return False
        final = error if not isinstance(error, EngineRestartingError) else EngineDeadError(
            f"the engine could not be restarted after {policy.attempts} attempts "
            f"(it first died: {reason})")
        with self._lock:
            if not self._closed:
                self._error = final
        logger.error("the engine is dead: %s", final)
        if self.on_fatal is not None:
            self.on_fatal(str(final))
        return False

    def _start_again(self, reason: str, died: float) -> bool:
        policy = self.restart_policy
        assert policy is not None
        for attempt in range(policy.attempts):
            delay = policy.delay(attempt)
            logger.warning("restarting the engine (attempt %d of %d) in %.1f s", attempt + 1,
                           policy.attempts, delay)
            if self._closing.wait(delay):
                return False
            started = time.monotonic()
            try:
                procs = _Processes(self.config, self.args, self._home, self.rank, self._manager,
                                   self._closing)
            except Exception as e:  # noqa: BLE001 - logged; the next attempt follows
                logger.error("engine restart attempt %d of %d failed: %s", attempt + 1,
                             policy.attempts, e)
                if self._closing.is_set():
                    return False
                continue
            with self._lock:
                closed = self._closed
                if not closed:
                    self._procs, self._error = procs, None
                    self.restarts += 1
                    self._start_s = time.monotonic() - started
            if closed:  # shut down while starting: stop what just started
                procs.stop(EngineDeadError("the engine has been shut down"), graceful=True)
                return False
            logger.warning("the engine serves again, %.1f s after it died (%s)",
                           time.monotonic() - died, reason)
            return True
        return False


def _copy(error: EngineDeadError) -> EngineDeadError:
    """A fresh exception like `error` (class and attributes), for a new raise."""
    return copy.copy(error)

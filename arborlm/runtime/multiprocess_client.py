"""`MultiProcessClient`: the engine as processes — the server's setup behind `Engine`.

```
this process:  Engine → MultiProcessClient → TokenizerManager ──ipc──▶ scheduler process
                                                   ▲                          │
                                                   └──ipc── detokenizer ◀─────┘
```

The constructor resolves the configuration, makes a private socket directory (`IpcAddresses`),
spawns the scheduler process (which loads the model) and the detokenizer process, loads the
tokenizer and binds the tokenizer manager's socket while they start, and waits for both to
report ready; a child that fails to start makes the constructor raise the child's error (the
same `arborlm.errors` class where it raised one). The scheduler's KV capacity arrives with its
ready message.

Liveness: a watchdog thread checks the children every `WATCH_INTERVAL_S`. When one has died, the
engine turns unhealthy, every pending call fails with `EngineDeadError("scheduler process died
(exit code -9)")`-style errors, later calls raise it at once, and the surviving child is
stopped. `shutdown()` (also run at interpreter exit and on SIGTERM, see `process_utils`) sends a
`ShutdownReq` through the pipeline, waits for the children, escalates to SIGTERM / SIGKILL, and
removes the socket directory. Children stop by themselves if this process dies.

Caveat of the "spawn" start method: a script that creates a multi-process engine at import time
must guard it with `if __name__ == "__main__":`, since the children import the main module.
This module imports no model or scheduler code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

from arborlm.errors import EngineDeadError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.engine_client import EngineClient
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.runtime.ipc import IpcAddresses
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
WATCH_INTERVAL_S = 0.5
SHUTDOWN_TIMEOUT_S = 5.0  # how long children get to exit after a ShutdownReq


def scheduler_env() -> dict[str, str]:
    """Environment of the scheduler process. OpenMP threads that spin while waiting (the
    default) starve the detokenizer and this process of CPU on a small machine and slow every
    step of a CPU scheduler many times over; passive waiting avoids it. A value the user set
    is kept."""
    return {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}


class MultiProcessClient(EngineClient):
    def __init__(self, args: EngineArgs):
        self.config = args.resolve()
        # Children get the resolved paths, so they need not resolve defaults again.
        self.args = dataclasses.replace(args, model_path=self.config.model.path,
                                        tokenizer_path=self.config.tokenizer_path)
        self.addrs = IpcAddresses.create()
        self.children: list[ChildProcess] = []
        self._lock = threading.Lock()
        self._torn_down = False
        self._closing = threading.Event()
        try:
            run_dir = self.addrs.run_dir
            self.children = [
                spawn_child("scheduler", SCHEDULER_ENTRY, self.args, self.addrs,
                            cleanup_dir=run_dir, env=scheduler_env()),
                spawn_child("detokenizer", DETOKENIZER_ENTRY, self.config.tokenizer_path,
                            self.addrs, cleanup_dir=run_dir),
            ]
            # The children start meanwhile (the detokenizer connects to this socket when bound).
            self.tokenizer = load_tokenizer(self.config.tokenizer_path)
            self.tm = TokenizerManager(self.config, self.tokenizer, self.addrs, args.random_seed)
            infos = wait_ready(self.children, STARTUP_TIMEOUT_S)
        except BaseException:
            self._teardown(EngineDeadError("the engine failed to start"), graceful=False)
            raise
        self.tm.start(infos["scheduler"]["max_total_tokens"])
        self._watchdog = threading.Thread(target=self._watch, name="arborlm-watchdog",
                                          daemon=True)
        self._watchdog.start()
        register_for_cleanup(self)

    @property
    def max_total_tokens(self) -> int:
        return self.tm.max_total_tokens

    def pids(self) -> dict[str, int]:
        """Process ids of the children, by name ("scheduler", "detokenizer")."""
        return {c.name: c.pid for c in self.children}

    # --- EngineClient -------------------------------------------------------------------------

    def generate(self, req: GenerateRequest) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        return self.tm.generate(req)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.tm.abort(rid, abort_all)

    async def flush_cache(self) -> tuple[bool, str]:
        return await self.tm.flush_cache()

    async def server_info(self) -> dict[str, Any]:
        return await self.tm.server_info()

    async def health_check(self) -> bool:
        """True after a round trip through both children."""
        return await self.tm.health_check()

    def healthy(self) -> bool:
        return not self._torn_down and all(c.is_alive() for c in self.children)

    def shutdown(self) -> None:
        self._teardown(EngineDeadError("the engine has been shut down"), graceful=True)

    # --- lifecycle ----------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closing.wait(WATCH_INTERVAL_S):
            dead = next((c for c in self.children if not c.is_alive()), None)
            if dead is not None:
                message = dead.death_message()
                logger.error("%s; failing every pending request", message)
                self._teardown(EngineDeadError(message), graceful=False)
                return

    def _teardown(self, error: EngineDeadError, graceful: bool) -> None:
        """Fail pending calls with `error`, stop the children, remove the sockets; runs once."""
        with self._lock:
            if self._torn_down:
                return
            self._torn_down = True
        self._closing.set()
        tm = getattr(self, "tm", None)
        if tm is not None:
            tm.fail_all(error)
            if graceful and all(c.is_alive() for c in self.children):
                tm.send_shutdown()
        for child in self.children:
            child.stop(SHUTDOWN_TIMEOUT_S if graceful else 0.0)
        if tm is not None:
            tm.close(error)
        self.addrs.cleanup()
        unregister(self)
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(timeout=2 * WATCH_INTERVAL_S)

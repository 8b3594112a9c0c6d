"""`ArborServer`: uvicorn's server with ArborLM's ready line and a clean exit after SIGTERM.

uvicorn already does the graceful part of a shutdown — stop accepting, wait for in-flight
connections up to `timeout_graceful_shutdown`, cancel the rest, run the app's shutdown — but
then re-raises the captured signal so the process ends with the signal's status. The drain is
complete by then, so this server exits normally instead (status 0). `stop_when`, an event set
from any thread (the engine could not be restarted), starts the same graceful shutdown.
Imported only when serving.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

logger = logging.getLogger("arborlm.server")


class ArborServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ready_note: str,
                 stop_when: threading.Event | None = None):
        super().__init__(config)
        self.ready_note = ready_note
        self.stop_when = stop_when or threading.Event()

    async def on_tick(self, counter: int) -> bool:
        if self.stop_when.is_set() and not self.should_exit:
            logger.error("stopping the server: the engine is dead")
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        logger.info("ArborLM server ready at http://%s:%d (%s)", host, port, self.ready_note)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()  # drained: do not re-raise the signal

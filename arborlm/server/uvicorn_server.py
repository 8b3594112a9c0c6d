"""`ArborServer`: uvicorn's server with ArborLM's ready line and a clean exit after SIGTERM.

uvicorn already does the graceful part of a shutdown — stop accepting, wait for in-flight
connections up to `timeout_graceful_shutdown`, cancel the rest, run the app's shutdown — but
then re-raises the captured signal so the process ends with the signal's status. The drain is
complete by then, so this server exits normally instead (status 0). Imported only when serving.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import uvicorn

logger = logging.getLogger("arborlm.server")


class ArborServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ready_note: str):
        super().__init__(config)
        self.ready_note = ready_note

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

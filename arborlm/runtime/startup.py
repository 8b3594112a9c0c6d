"""Startup phases: what a starting engine process is doing, announced as each step begins.

`phase(name)` marks the start of a phase ("compiling kernels", "loading weights", "allocating
the KV pool", "warming up"). In an engine child process `process_utils` installs a reporter
that sends each phase to the parent, which logs it with elapsed times and names the phase when
a start fails or takes long; elsewhere a phase is logged at INFO with the time since the
previous one. This module knows nothing of processes or of what the phases do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_reporter: Callable[[str], None] | None = None
_last: tuple[str, float] | None = None  # the phase logged last here, and when it began


def set_reporter(reporter: Callable[[str], None] | None) -> None:
    """Send every later phase to `reporter` (None: log them here)."""
    global _reporter
    _reporter = reporter


def phase(name: str) -> None:
    """The process starts `name` now (the previous phase, if any, has ended)."""
    global _last
    if _reporter is not None:
        _reporter(name)
        return
    now = time.monotonic()
    if _last is None:
        logger.info("startup: %s", name)
    else:
        logger.info("startup: %s (%s took %.1f s)", name, _last[0], now - _last[1])
    _last = (name, now)

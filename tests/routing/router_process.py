"""A real `arborlm router` in a subprocess, for the router tests (like `server_process`).

`running_router(*flags)` starts `python -m arborlm.routing.cli --host 127.0.0.1 --port 0
*flags`, waits for its ready line and `/list_workers`, and on exit stops it with SIGTERM and
asserts that it exited with status 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.server.server_process import READY

STARTUP_TIMEOUT_S = 120.0


@contextlib.contextmanager
def running_router(*flags: str) -> Iterator[str]:
    log = Path(tempfile.mkstemp(prefix="arborlm-router-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "arborlm.routing.cli", "--host", "127.0.0.1", "--port", "0",
           *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _wait_ready(proc, log)
        yield url
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert code == 0, f"router exited with {code}:\n{log.read_text()[-3000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)


def _wait_ready(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{log.read_text()}")
        match = READY.search(log.read_text())
        if match is not None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(match.group(1) + "/list_workers", timeout=5).status_code == 200:
                    return match.group(1)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"router not ready after {STARTUP_TIMEOUT_S} s:\n{log.read_text()}")

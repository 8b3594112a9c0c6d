"""A real ArborLM server in a subprocess, for the server tests.

`running_server(model_path, *flags, env=None)` starts `python -m arborlm.server` (without
`--model-path` when `model_path` is None: the default model) on a free loopback port (`--port 0`;
the port is read from the server's ready line) with `env` added to its environment, waits until
`/health` answers, and on exit stops it with SIGTERM and asserts that it exited with status 0 and
left no child process behind. The server's log goes to a temporary file, printed when startup
fails. The engine mode is the server's default (multi-process) unless `$ARBORLM_TEST_ENGINE_MODE`
names one, e.g. `ARBORLM_TEST_ENGINE_MODE=inprocess pytest tests/server`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

READY = re.compile(r"ArborLM server ready at (http://[\d.]+:\d+)")
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0


class ServerProcess:
    def __init__(self, model_path: str | Path | None, flags: list[str],
                 env: dict[str, str] | None = None):
        self.log = Path(tempfile.mkstemp(prefix="arborlm-server-", suffix=".log")[1])
        model = [] if model_path is None else ["--model-path", str(model_path)]
        cmd = [sys.executable, "-m", "arborlm.server", *model,
               "--host", "127.0.0.1", "--port", "0", *flags]
        if os.environ.get("ARBORLM_TEST_ENGINE_MODE"):
            cmd += ["--engine-mode", os.environ["ARBORLM_TEST_ENGINE_MODE"]]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1",
                                              **(env or {})})
        self.url = ""
        self.children: list[psutil.Process] = []

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()}")
            match = READY.search(self.log_text())
            if match is not None:
                self.url = match.group(1)
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        self.children = psutil.Process(self.proc.pid).children(recursive=True)
                        return self.url
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log_text()}")

    def terminate(self) -> int:
        """SIGTERM, wait for the exit; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def refresh_children(self) -> None:
        """Note the server's descendants now (after its engine was replaced)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.children = psutil.Process(self.proc.pid).children(recursive=True)

    def assert_no_children_left(self) -> None:
        _, alive = psutil.wait_procs(self.children, timeout=10)
        assert not alive, f"children left running: {alive}"

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for child in self.children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        self.log.unlink(missing_ok=True)


@contextlib.contextmanager
def running_server(model_path: str | Path | None, *flags: str,
                   env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    server = ServerProcess(model_path, list(flags), env)
    try:
        server.wait_ready()
        yield server
        server.refresh_children()
        code = server.terminate()
        assert code == 0, f"server exited with {code}:\n{server.log_text()[-3000:]}"
        server.assert_no_children_left()
    finally:
        server.cleanup()

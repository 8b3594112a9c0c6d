"""`arborlm serve --tp-size 2` (multi-process engine): it serves what one rank serves, and a
SIGKILLed worker rank ends its engine with an error naming the rank; the engine-restart logic
then starts a fresh engine with fresh ranks, which serves the same greedy output again.
Nothing hangs, and the server leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.server.server_process import running_server

GREEDY = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}
FLAGS = ("--dtype", "float32", "--max-total-tokens", "4096")
TIMEOUT_S = 120.0
DEADLINE_S = 180.0


def _generate(url: str) -> httpx.Response:
    return httpx.post(url + "/generate", json={"text": "Hello there", "sampling_params": GREEDY},
                      timeout=TIMEOUT_S)


def _worker_ranks(server_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(server_pid).children(recursive=True)
            if "arborlm.runtime.distributed.worker" in " ".join(p.cmdline())]


def _poll(what: str, check):
    deadline = time.monotonic() + DEADLINE_S
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} not within {DEADLINE_S} s"
        time.sleep(0.1)
    return value


@pytest.mark.slow  # three server starts (one rank, two ranks, the restart)
def test_killed_rank_restarts_the_engine(make_tiny_model):
    path = make_tiny_model("llama")
    with running_server(path, *FLAGS) as one:
        want = _generate(one.url).json()
    with running_server(path, *FLAGS, "--tp-size", "2") as server:
        assert _generate(server.url).json()["output_ids"] == want["output_ids"]
        [rank1] = _worker_ranks(server.proc.pid)
        os.kill(rank1.pid, signal.SIGKILL)

        def refused() -> httpx.Response | None:
            r = _generate(server.url)
            return r if r.status_code == 503 else None

        r = _poll("a 503 from the dead engine", refused)
        assert f"tensor-parallel rank 1 (pid {rank1.pid}) exited with code -9" in \
            r.json()["error"]["message"], r.text
        _poll("serving again", lambda: _generate(server.url).status_code == 200)
        assert _generate(server.url).json()["output_ids"] == want["output_ids"]
        [fresh] = _worker_ranks(server.proc.pid)
        assert fresh.pid != rank1.pid
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        assert info["engine_restarts"] == 1

"""A starting child process is never waited on silently: its startup phases reach the parent,
a child that dies while starting is reported at once with its exit code, phase and last output
lines, and one that hangs fails the start naming the phase it hangs in.

Regression tests for: a scheduler stuck on a stale build lock left the server waiting without a
word for 600 s, then failing with "scheduler process(es) did not start within 600 s".
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from arborlm.errors import EngineDeadError
from arborlm.runtime import process_utils, startup
from arborlm.runtime.process_utils import spawn_child, wait_ready

ENTRY = "tests.runtime.test_process_startup:"
TIMEOUT_S = 600.0  # the start timeout the server uses


class DiesWhileStarting:
    """A service that dies in its constructor, as an OOM-killed model load would."""

    def __init__(self, code: int):
        startup.phase("loading weights")
        print("allocating 80 GB for the weights", flush=True)
        os._exit(code)


class HangsWhileStarting:
    """A service stuck in its constructor, as on a lock nobody will release."""

    def __init__(self) -> None:
        startup.phase("compiling kernels")
        print("waiting for the build lock", flush=True)
        threading.Event().wait()


def _poll(what: str, check, deadline_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {deadline_s} s"
        time.sleep(0.02)


def test_child_that_dies_while_starting_is_reported_at_once(caplog):
    child = spawn_child("scheduler", ENTRY + "DiesWhileStarting", 3)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger=process_utils.logger.name):
            with pytest.raises(EngineDeadError) as info:
                wait_ready([child], TIMEOUT_S)
        took = time.monotonic() - start
    finally:
        child.stop(0.0)
    message = str(info.value)
    assert "scheduler process exited during startup (loading weights) (exit code 3)" in message
    assert message.endswith("its last output:\nallocating 80 GB for the weights")
    assert "scheduler process: loading weights" in caplog.text  # the phase was logged
    assert took < TIMEOUT_S / 10  # noticed when it died, not at the timeout


def test_child_that_hangs_while_starting_names_its_phase(caplog, monkeypatch):
    monkeypatch.setattr(process_utils, "STILL_WAITING_LOG_S", 0.2)
    child = spawn_child("scheduler", ENTRY + "HangsWhileStarting")
    try:
        _poll("the compiling phase", lambda: child.poll_ready(0.05) is None
              and child.phase == "compiling kernels" and child.output.lines)
        with caplog.at_level(logging.INFO, logger=process_utils.logger.name):
            with pytest.raises(EngineDeadError) as info:
                wait_ready([child], 1.0)
    finally:
        child.stop(0.0)
    assert str(info.value) == ("scheduler process did not start within 1 s (its last phase: "
                               "compiling kernels); its last output:\nwaiting for the build lock")
    assert "scheduler process: still compiling kernels after" in caplog.text


def test_fail_start_hook_refuses_while_its_file_exists(tmp_path, monkeypatch):
    flag = tmp_path / "refuse"
    monkeypatch.setenv(process_utils.FAIL_START_ENV, str(flag))
    flag.touch()
    child = spawn_child("detokenizer", ENTRY + "HangsWhileStarting")
    try:
        with pytest.raises(EngineDeadError, match="start refused by the test hook"):
            wait_ready([child], TIMEOUT_S)
    finally:
        child.stop(0.0)

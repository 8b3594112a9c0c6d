"""Failures reach the caller — from the program's own code, from the backend, in a batch, in a
stream, in a forked branch — and never leave it waiting."""

from __future__ import annotations

import threading

import pytest

import arborlm.lang as sgl
from arborlm.errors import InvalidRequestError
from arborlm.lang.errors import BackendError, ProgramError
from tests.lang.conftest import GREEDY

HANG_TIMEOUT_S = 60


def within_timeout(fn):
    """fn() on a thread; fails the test if it has not returned within HANG_TIMEOUT_S."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_TIMEOUT_S)
    assert not thread.is_alive(), "the program hung"
    if "error" in box:
        raise box["error"]
    return box["value"]


class ToolFailed(Exception):
    pass


@sgl.function
def failing_body(s, fail):
    s += "Hello" + sgl.gen("x", max_tokens=2)
    if fail:
        raise ToolFailed("the tool broke")
    s += "!"


@sgl.function
def bad_gen(s):
    s += "Hello"
    s += sgl.gen("x", max_tokens=2, temperature=-1.0)  # the runtime rejects this


def test_exception_in_the_program_body_reaches_run(backend):
    with pytest.raises(ToolFailed):
        within_timeout(lambda: failing_body.run(True, backend=backend))


def test_backend_error_is_reported_on_read(backend):
    state = within_timeout(lambda: bad_gen.run(backend=backend))
    error = state.error()
    assert isinstance(error, (BackendError, InvalidRequestError))
    assert "temperature" in str(error)
    with pytest.raises(ProgramError) as info:
        within_timeout(lambda: state["x"])
    assert info.value.__cause__ is error
    assert state.text() == "Hello"


def test_reading_a_failed_variable_inside_the_program_raises_from_run(backend):
    @sgl.function
    def prog(s):
        s += "Hi"
        s += sgl.gen("x", max_tokens=2, top_p=5.0)
        return s["x"]

    with pytest.raises(ProgramError):
        within_timeout(lambda: prog.run(backend=backend))


def test_appending_after_a_failure_raises(backend):
    @sgl.function
    def prog(s):
        s += sgl.gen("x", max_tokens=2, top_k=0)
        s.sync()
        s += "more"

    with pytest.raises(ProgramError, match="already failed"):
        within_timeout(lambda: prog.run(backend=backend))


def test_run_batch_keeps_failures_per_program(backend):
    states = within_timeout(lambda: failing_body.run_batch(
        [{"fail": i == 2} for i in range(4)], backend=backend, **GREEDY))
    assert [type(s.error()) for s in states] == [type(None)] * 2 + [ToolFailed] + [type(None)]
    assert states[0].text().endswith("!")
    assert isinstance(states[2]["x"], str)  # produced before the tool failed
    with pytest.raises(ProgramError):
        states[2]["missing"]


def test_stream_of_a_failed_program_ends_with_the_error(backend):
    state = bad_gen.run(backend=backend, stream=True)
    with pytest.raises(ProgramError):
        within_timeout(lambda: list(state.text_iter()))
    with pytest.raises(ProgramError):
        within_timeout(lambda: list(failing_body.run(True, backend=backend, stream=True)
                                    .text_iter()))


def test_failed_branch_fails_the_join(backend):
    @sgl.function
    def prog(s):
        s += "Start."
        forks = s.fork(2)
        forks += [sgl.gen("x", max_tokens=2), sgl.gen("x", max_tokens=2, min_p=3.0)]
        forks.join()

    with pytest.raises(ProgramError, match="branch failed"):
        within_timeout(lambda: prog.run(backend=backend))


def test_unreachable_server_is_a_backend_error():
    from arborlm.lang.backends.runtime_endpoint import RuntimeEndpoint

    with pytest.raises(BackendError, match="failed"):
        RuntimeEndpoint("http://127.0.0.1:9", timeout=5)

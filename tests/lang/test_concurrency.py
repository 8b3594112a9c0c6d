"""Programs and forked branches run concurrently: each state has its own worker, so their
backend calls overlap, and the in-process engine batches them."""

from __future__ import annotations

import threading

import arborlm.lang as sgl
from arborlm.lang.backends.base import BaseBackend
from arborlm.lang.choices import ChoicesDecision
from arborlm.lang.errors import BackendError


class BarrierBackend(BaseBackend):
    """A fake backend whose `gen` returns only once `parties` gens are in flight together: a
    program that runs its gens one after another fails with a broken barrier."""

    def __init__(self, parties: int, timeout: float = 20.0):
        self.barrier = threading.Barrier(parties, timeout=timeout)
        self.calls = 0
        self.lock = threading.Lock()

    def generate(self, s, params):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError as e:
            raise BackendError("gens did not run concurrently") from e
        with self.lock:
            self.calls += 1
        return "ok", {"completion_tokens": 1}

    def generate_stream(self, s, params):
        yield self.generate(s, params)

    def select(self, s, choices, temperature, choices_method):
        return ChoicesDecision(choices[0])


def test_forked_branches_call_the_backend_concurrently():
    backend = BarrierBackend(4)

    @sgl.function
    def fan(s):
        s += "Shared."
        forks = s.fork(4)
        forks += sgl.gen("x")
        forks.join()

    state = fan.run(backend=backend)
    assert state.error() is None
    assert state["x"] == ["ok"] * 4 and backend.calls == 4


def test_batch_programs_call_the_backend_concurrently():
    backend = BarrierBackend(6)

    @sgl.function
    def one(s, i):
        s += f"Program {i}:" + sgl.gen("x")

    states = one.run_batch([{"i": i} for i in range(6)], backend=backend, num_threads=6)
    assert [s["x"] for s in states] == ["ok"] * 6


def test_sequential_gens_in_one_program_do_not_overlap():
    backend = BarrierBackend(2, timeout=1.0)

    @sgl.function
    def two_in_a_row(s):
        s += sgl.gen("a") + sgl.gen("b")

    error = two_in_a_row.run(backend=backend).error()
    assert isinstance(error, BackendError)  # the second gen waits for the first


def test_engine_batches_concurrent_programs(engine_backend):
    @sgl.function
    def one(s, i):
        s += f"Story {i}:" + sgl.gen("x", max_tokens=8, ignore_eos=True)

    before = engine_backend.get_server_info()["decode_steps"]
    states = one.run_batch([{"i": i} for i in range(16)], backend=engine_backend)
    steps = engine_backend.get_server_info()["decode_steps"] - before
    assert all(s.get_meta_info("x")["completion_tokens"] == 8 for s in states)
    # 16 programs x 7 decode steps each, run together: far fewer steps than one by one.
    assert steps < 16 * 7 / 3, steps

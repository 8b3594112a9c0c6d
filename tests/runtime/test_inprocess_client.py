"""The in-process client builds and runs its scheduler on its own thread.

The caller's thread never runs the model: a thread that has run a parallel torch op keeps an
OpenMP team, and with more OpenMP threads than cores libgomp stops spinning between parallel
regions (see `InProcessClient._start`). An error while building reaches the caller.
"""

from __future__ import annotations

import threading

import pytest

from arborlm import Engine
from arborlm.errors import ModelLoadError
from arborlm.runtime import inprocess_client
from arborlm.runtime.scheduler.scheduler import Scheduler


def test_model_is_built_and_run_on_the_scheduler_thread(make_tiny_model, monkeypatch):
    threads = {"init": set(), "step": set()}

    class Recording(Scheduler):
        def __init__(self, *args, **kwargs):
            threads["init"].add(threading.current_thread().name)
            super().__init__(*args, **kwargs)

        def step(self):
            threads["step"].add(threading.current_thread().name)
            return super().step()

    monkeypatch.setattr(inprocess_client, "Scheduler", Recording)
    engine = Engine(str(make_tiny_model("llama")), dtype="float32")
    out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4,
                                                                   "temperature": 0})
    engine.shutdown()
    assert len(out["output_ids"]) == 4
    assert threads == {"init": {"arborlm-scheduler"}, "step": {"arborlm-scheduler"}}


def test_build_error_reaches_the_caller(make_tiny_model, monkeypatch):
    def failing(*args, **kwargs):
        raise ModelLoadError("the weights could not be read")

    monkeypatch.setattr(inprocess_client, "Scheduler", failing)
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ModelLoadError, match="could not be read"):
        Engine(str(make_tiny_model("llama")), dtype="float32")
    for t in threading.enumerate():
        if t.name == "arborlm-scheduler" and "arborlm-scheduler" not in before:
            t.join(timeout=5)
            assert not t.is_alive()


def test_shutdown_frees_the_kv_pool_and_the_weights(make_tiny_model):
    # The scheduler's parts refer to one another; shutdown must not leave them (the whole KV
    # pool, by default a quarter of the free memory) to the next cyclic collection.
    import gc
    import weakref

    gc.disable()  # so that only shutdown itself can have collected them
    try:
        engine = Engine(str(make_tiny_model("llama")), dtype="float32", max_total_tokens=4096)
        runner = engine.client.scheduler.runner
        alive = [weakref.ref(runner.kv_pool.k_buffer[0]),
                 weakref.ref(next(runner.model.parameters())), weakref.ref(runner)]
        del runner
        engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
        engine.shutdown()
        assert [ref() is None for ref in alive] == [True, True, True]
        with pytest.raises(RuntimeError, match="shut down"):
            engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    finally:
        gc.enable()


def test_a_caller_whose_event_loop_closed_ends_its_request_only(make_tiny_model):
    """A caller gone mid-request (its event loop closed with the request's stream unclosed, as
    when a test times out or a notebook cell is interrupted): the scheduler thread drops that
    request's events and aborts it, and the engine serves the next request."""
    import asyncio

    from arborlm.runtime.generate_request import GenerateRequest

    engine = Engine(str(make_tiny_model("llama")), dtype="float32", max_total_tokens=4096)
    try:
        req = GenerateRequest(input_ids=[5, 6, 7], stream=True, sampling_params={
            "max_new_tokens": 200, "ignore_eos": True, "temperature": 0})

        streams = []  # held, so that no finalizer closes the stream while the loop runs

        async def first_event_then_leave():
            streams.append(engine.client.generate(req))
            return await streams[0].__anext__()

        loop = asyncio.new_event_loop()
        index, event = loop.run_until_complete(first_event_then_leave())
        loop.close()
        rid = event["meta_info"]["id"]
        out = engine.generate(input_ids=[8, 9], sampling_params={"max_new_tokens": 4})
        assert len(out["output_ids"]) == 4
        assert engine.client._error is None
        assert rid not in engine.client._sinks
        # Asked on the scheduler's own thread: nothing is left running (the 200 tokens would
        # otherwise still be decoding).
        assert engine.get_server_info()["num_running_reqs"] == 0
    finally:
        engine.shutdown()

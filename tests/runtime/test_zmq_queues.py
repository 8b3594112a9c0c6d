"""Typed queues over real ipc:// sockets in a private temporary directory."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import stat
import statistics
import time

import pytest

from arborlm.runtime.ipc import IpcAddresses
from arborlm.runtime.messages import AbortReq, ErrorOutput, HealthCheckReq, ShutdownReq
from arborlm.runtime.zmq_queues import AsyncPullQueue, PullQueue, PushQueue


@pytest.fixture
def addrs():
    a = IpcAddresses.create()
    yield a
    a.cleanup()


def _socket_files(addrs: IpcAddresses) -> list[str]:
    return sorted(os.listdir(addrs.run_dir))


# --- addresses ---------------------------------------------------------------------------------


def test_addresses_live_in_a_private_directory(addrs):
    mode = stat.S_IMODE(os.stat(addrs.run_dir).st_mode)
    assert mode == 0o700
    assert os.path.basename(addrs.run_dir).startswith("arborlm-")
    every = addrs.all_addresses()
    assert len(set(every)) == 3
    for a in every:
        assert a.startswith(f"ipc://{addrs.run_dir}/")
    assert pickle.loads(pickle.dumps(addrs)) == addrs


def test_each_engine_gets_its_own_directory(tmp_path):
    a, b = IpcAddresses.create(str(tmp_path)), IpcAddresses.create(str(tmp_path))
    assert a.run_dir != b.run_dir
    assert os.path.dirname(a.run_dir) == str(tmp_path)
    a.cleanup()
    assert not os.path.exists(a.run_dir) and os.path.isdir(b.run_dir)
    b.cleanup()
    b.cleanup()
    assert os.listdir(tmp_path) == []


def test_too_long_socket_path_is_refused(tmp_path):
    deep = tmp_path / ("d" * 120)
    with pytest.raises(ValueError, match="longer than"):
        IpcAddresses.create(str(deep))
    assert os.listdir(deep) == []


# --- queues ------------------------------------------------------------------------------------


def test_many_messages_arrive_in_order(addrs):
    n = 20_000
    with (
        PullQueue(addrs.tokenizer_to_scheduler, bind=True) as pull,
        PushQueue(addrs.tokenizer_to_scheduler, bind=False) as push,
    ):
        for i in range(n):
            push.put(AbortReq(rid=str(i)))
        got = []
        while len(got) < n:
            msg = pull.get(timeout=5)
            assert msg is not None
            got.append(msg)
            got.extend(pull.get_nowait_all())
    assert [int(m.rid) for m in got] == list(range(n))


def test_connect_side_may_start_first(addrs):
    push = PushQueue(addrs.scheduler_to_detokenizer, bind=False)
    push.put(HealthCheckReq())
    with PullQueue(addrs.scheduler_to_detokenizer, bind=True) as pull:
        assert pull.get(timeout=5) == HealthCheckReq()
    push.close()
    push.close()
    assert push.closed


def test_timeout_returns_none(addrs):
    with PullQueue(addrs.detokenizer_to_tokenizer, bind=True) as pull:
        start = time.monotonic()
        assert pull.get(timeout=0.05) is None
        assert time.monotonic() - start >= 0.04
        assert pull.get(timeout=0) is None
        assert pull.get_nowait_all() == []


def test_only_messages_can_be_sent(addrs):
    with (
        PullQueue(addrs.tokenizer_to_scheduler, bind=True) as pull,
        PushQueue(addrs.tokenizer_to_scheduler, bind=False) as push,
    ):
        for bad in ({"rid": "x"}, b"raw bytes", "text"):
            with pytest.raises(TypeError):
                push.put(bad)
        push.put(ShutdownReq())
        assert pull.get(timeout=5) == ShutdownReq()
        assert pull.get_nowait_all() == []


def test_cleanup_leaves_no_files(addrs):
    pulls = [PullQueue(a, bind=True) for a in addrs.all_addresses()]
    assert len(_socket_files(addrs)) == 3
    for q in pulls:
        q.close()
    addrs.cleanup()
    assert not os.path.exists(addrs.run_dir)


def test_async_pull_queue(addrs):
    async def main() -> list[str]:
        with (
            AsyncPullQueue(addrs.detokenizer_to_tokenizer, bind=True) as pull,
            PushQueue(addrs.detokenizer_to_tokenizer, bind=False) as push,
        ):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pull.get(), timeout=0.05)
            for i in range(100):
                push.put(ErrorOutput(rid=str(i), message="m"))
            return [(await pull.get()).rid for _ in range(100)]

    assert asyncio.run(main()) == [str(i) for i in range(100)]


# --- across processes --------------------------------------------------------------------------


def _echo(addrs: IpcAddresses) -> None:
    """Child process: send back every message until a ShutdownReq."""
    with (
        PullQueue(addrs.tokenizer_to_scheduler, bind=True) as pull,
        PushQueue(addrs.detokenizer_to_tokenizer, bind=False) as push,
    ):
        while True:
            msg = pull.get()
            push.put(msg)
            if isinstance(msg, ShutdownReq):
                return


def test_round_trip_between_processes(addrs):
    child = mp.get_context("spawn").Process(target=_echo, args=(addrs,), daemon=True)
    child.start()
    try:
        with (
            PushQueue(addrs.tokenizer_to_scheduler, bind=False) as push,
            PullQueue(addrs.detokenizer_to_tokenizer, bind=True) as pull,
        ):
            push.put(AbortReq(rid="warmup"))
            assert pull.get(timeout=60) == AbortReq(rid="warmup")
            latencies = []
            for i in range(500):
                start = time.perf_counter()
                push.put(AbortReq(rid=str(i)))
                msg = pull.get(timeout=5)
                latencies.append(time.perf_counter() - start)
                assert msg == AbortReq(rid=str(i))
            push.put(ShutdownReq())
            assert pull.get(timeout=5) == ShutdownReq()
        p50 = statistics.median(latencies) * 1e6
        p99 = sorted(latencies)[int(0.99 * len(latencies))] * 1e6
        print(f"\nipc round trip through a child process: p50 {p50:.0f} us, p99 {p99:.0f} us")
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0

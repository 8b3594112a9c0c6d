"""`arborlm router` over real `arborlm serve` workers on loopback: outputs equal a single
server's (greedy; native, OpenAI, streaming), cache-aware routing keeps a prefix on one worker,
workers are added and removed at run time, and a worker killed mid-run loses no request."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket

import httpx
import pytest

from arborlm.routing.router_app import WORKER_HEADER
from tests.routing.router_process import running_router
from tests.server.server_process import ServerProcess, running_server

SERVER_FLAGS = ("--context-length", "1024", "--max-total-tokens", "16384")
GREEDY = {"temperature": 0, "max_new_tokens": 8}
PROMPTS = ["The quick brown fox", "Once upon a time", "In a galaxy far away", "Hello, my name"]
CLIENT_TIMEOUT_S = 300.0  # an answer that takes longer has hung
LONG = 800  # new tokens of the killed-worker test's requests


@pytest.fixture(scope="module")
def workers(make_tiny_model):
    model = make_tiny_model("llama")
    with running_server(model, *SERVER_FLAGS) as a, running_server(model, *SERVER_FLAGS) as b:
        yield a.url, b.url


def _generate(url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(url + "/generate", json={"text": prompt, "sampling_params": GREEDY,
                                              **extra}, timeout=CLIENT_TIMEOUT_S)


def _stream_events(url: str, path: str, body: dict) -> tuple[str, list]:
    with httpx.stream("POST", url + path, json={**body, "stream": True},
                      timeout=CLIENT_TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        return r.headers.get(WORKER_HEADER, ""), events


def test_outputs_equal_a_single_server(workers):
    single = workers[0]
    with running_router("--worker-urls", *workers, "--policy", "round_robin") as router:
        served_by = set()
        for prompt in PROMPTS:
            direct = _generate(single, prompt).json()
            routed = _generate(router, prompt)
            assert routed.status_code == 200
            served_by.add(routed.headers[WORKER_HEADER])
            assert routed.json()["output_ids"] == direct["output_ids"]
            assert routed.json()["text"] == direct["text"]
        assert served_by == set(workers)

        batch = _generate(router, PROMPTS).json()
        assert [o["text"] for o in batch] == [_generate(single, p).json()["text"]
                                              for p in PROMPTS]

        body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        direct = httpx.post(single + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S)
        for _ in workers:  # both workers, in turn
            routed = httpx.post(router + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S)
            assert routed.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]

        chat = {"model": "default", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": PROMPTS[1]}]}
        direct = httpx.post(single + "/v1/chat/completions", json=chat, timeout=CLIENT_TIMEOUT_S)
        routed = httpx.post(router + "/v1/chat/completions", json=chat, timeout=CLIENT_TIMEOUT_S)
        assert routed.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]

        native = {"text": PROMPTS[2], "sampling_params": GREEDY}
        _, direct_events = _stream_events(single, "/generate", native)
        for _ in workers:
            _, events = _stream_events(router, "/generate", native)
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["text"] == json.loads(direct_events[-2])["text"]
        _, events = _stream_events(router, "/v1/chat/completions", chat)
        streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                           for e in events[:-1] if json.loads(e)["choices"])
        assert streamed == direct.json()["choices"][0]["message"]["content"]


def test_worker_errors_reach_the_client_unchanged(workers):
    with running_router("--worker-urls", *workers) as router:
        bad = httpx.post(router + "/generate", json={"text": "x", "sampling_params": {
            "temperature": -1}}, timeout=CLIENT_TIMEOUT_S)
        direct = httpx.post(workers[0] + "/generate", json={"text": "x", "sampling_params": {
            "temperature": -1}}, timeout=CLIENT_TIMEOUT_S)
        assert bad.status_code == direct.status_code == 400
        assert bad.json() == direct.json()
        not_json = httpx.post(router + "/generate", content=b"{", timeout=CLIENT_TIMEOUT_S)
        assert not_json.status_code == 400
        assert "not JSON" in not_json.json()["error"]["message"]


def test_cache_aware_keeps_each_prefix_on_one_worker(workers):
    systems = [f"System prompt {i}: you are a helpful assistant for tenant number {i}. " * 3
               for i in range(4)]
    with running_router("--worker-urls", *workers, "--policy", "cache_aware") as router:
        owner: dict[int, str] = {}
        for round_ in range(3):
            for i, system in enumerate(systems):
                r = httpx.post(router + "/generate", timeout=CLIENT_TIMEOUT_S, json={
                    "text": system + f"Question {round_}?",
                    "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
                assert r.status_code == 200
                assert owner.setdefault(i, r.headers[WORKER_HEADER]) == r.headers[WORKER_HEADER]
        assert set(owner.values()) == set(workers)
        info = httpx.get(router + "/get_server_info", timeout=CLIENT_TIMEOUT_S).json()
        assert {w["url"] for w in info["workers"]} == set(workers)
        assert all(w["info"]["cache_hit_rate"] > 0 for w in info["workers"])


def test_workers_added_and_removed_at_run_time(workers):
    a, b = workers
    with running_router("--worker-urls", a, "--policy", "round_robin") as router:
        assert httpx.get(router + "/list_workers").json()["urls"] == [a]
        added = httpx.post(router + "/add_worker", params={"url": b})
        assert added.status_code == 200, added.text
        assert httpx.get(router + "/list_workers").json()["urls"] == [a, b]
        seen = {_generate(router, p).headers[WORKER_HEADER] for p in PROMPTS}
        assert seen == {a, b}

        again = httpx.post(router + "/add_worker", params={"url": b})
        assert again.status_code == 400 and "already registered" in again.text
        closed = f"http://127.0.0.1:{_closed_port()}"
        dead = httpx.post(router + "/add_worker", params={"url": closed})
        assert dead.status_code == 400 and "not healthy" in dead.json()["error"]["message"]

        assert httpx.post(router + "/remove_worker", params={"url": a}).status_code == 200
        assert {_generate(router, p).headers[WORKER_HEADER] for p in PROMPTS} == {b}
        missing = httpx.post(router + "/remove_worker", params={"url": a})
        assert missing.status_code == 400 and "not registered" in missing.text

        assert httpx.post(router + "/remove_worker", params={"url": b}).status_code == 200
        empty = _generate(router, PROMPTS[0])
        assert empty.status_code == 503
        assert "no worker is registered" in empty.json()["error"]["message"]
        assert httpx.get(router + "/health").status_code == 503


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_killed_worker_loses_no_request(workers, make_tiny_model):
    """A worker SIGKILLed with requests in flight: each request is answered by the survivor
    (non-streaming ones are retried there) or ends with an error event; none hangs."""
    survivor = workers[0]
    victim = ServerProcess(make_tiny_model("llama"), [*SERVER_FLAGS])
    try:
        victim.wait_ready()
        # Long enough that no request of the victim can finish between the first reaching it
        # and the kill, however busy the machine: each one in flight there must be retried.
        long = {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True}
        with running_router("--worker-urls", survivor, victim.url, "--policy", "round_robin",
                            "--health-check-interval", "1") as router:
            def plain(i: int) -> httpx.Response:
                return httpx.post(router + "/generate", timeout=CLIENT_TIMEOUT_S, json={
                    "text": PROMPTS[i % 4], "sampling_params": long})

            def streamed(i: int) -> tuple[str, list]:
                return _stream_events(router, "/generate", {"text": PROMPTS[i % 4],
                                                            "sampling_params": long})

            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                plains = [pool.submit(plain, i) for i in range(8)]
                streams = [pool.submit(streamed, i) for i in range(4)]
                _wait_for_victim_load(router, victim.url)
                os.kill(victim.proc.pid, signal.SIGKILL)
                answers = [f.result(timeout=CLIENT_TIMEOUT_S) for f in plains]
                stream_results = [f.result(timeout=CLIENT_TIMEOUT_S) for f in streams]
            for r in answers:
                assert r.status_code == 200, r.text
                assert r.headers[WORKER_HEADER] == survivor
                assert r.json()["meta_info"]["completion_tokens"] == LONG
            for worker, events in stream_results:
                assert events[-1] == "[DONE]"
                last = json.loads(events[-2])
                if worker == victim.url and "error" in last:
                    assert "failed during the stream" in last["error"]["message"]
                else:
                    assert last["meta_info"]["finish_reason"] is not None
            listed = httpx.get(router + "/list_workers").json()["workers"]
            assert [w["healthy"] for w in listed] == [True, False]
            after = _generate(router, PROMPTS[0])
            assert after.status_code == 200 and after.headers[WORKER_HEADER] == survivor
    finally:
        victim.cleanup()


def _wait_for_victim_load(router: str, victim: str) -> None:
    """Until the router has requests in flight on the victim (bounded; no fixed sleep)."""
    import time

    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while time.monotonic() < deadline:
        listed = httpx.get(router + "/list_workers").json()["workers"]
        if any(w["url"] == victim and w["in_flight"] >= 2 for w in listed):
            return
        time.sleep(0.05)
    raise AssertionError("the victim never had requests in flight")

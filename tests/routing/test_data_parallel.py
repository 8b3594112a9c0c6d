"""`arborlm serve --dp-size 2`: two engine replicas behind one server, on a tiny model. Outputs
equal a single engine's (greedy), `/get_server_info` reports each replica's cache, the
cache-aware policy keeps a prefix on the replica that cached it, and a replica killed mid-run
fails only its own requests (clearly) while the other keeps serving."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from tests.server.server_process import running_server

SERVER_FLAGS = ("--context-length", "1024", "--max-total-tokens", "16384")
GREEDY = {"temperature": 0, "max_new_tokens": 8}
PROMPTS = ["The quick brown fox", "Once upon a time", "In a galaxy far away", "Hello, my name"]
CLIENT_TIMEOUT_S = 300.0  # an answer that takes longer has hung


@pytest.fixture(scope="module")
def dp_server(make_tiny_model):
    with running_server(make_tiny_model("llama"), *SERVER_FLAGS, "--dp-size", "2",
                        "--load-balance-method", "cache_aware") as server:
        yield server.url


def _generate(url: str, text, params=GREEDY) -> httpx.Response:
    return httpx.post(url + "/generate", json={"text": text, "sampling_params": params},
                      timeout=CLIENT_TIMEOUT_S)


def _replicas(url: str) -> list[dict]:
    info = httpx.get(url + "/get_server_info", timeout=CLIENT_TIMEOUT_S).json()
    assert info["dp_size"] == 2
    return info["replicas"]


def test_outputs_equal_a_single_engine(dp_server, make_tiny_model):
    with running_server(make_tiny_model("llama"), *SERVER_FLAGS) as single:
        expected = [_generate(single.url, p).json() for p in PROMPTS]
        batch = _generate(single.url, PROMPTS).json()
    got = [_generate(dp_server, p).json() for p in PROMPTS]
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
    assert [o["text"] for o in _generate(dp_server, PROMPTS).json()] == [b["text"] for b in batch]
    replicas = _replicas(dp_server)
    assert [r["dp_rank"] for r in replicas] == [0, 1]
    assert len({r["scheduler_pid"] for r in replicas}) == 2
    assert all(r["prefill_tokens"] > 0 for r in replicas)  # distinct prompts: both served


def test_cache_aware_keeps_each_prefix_on_its_replica(dp_server):
    systems = [f"System prompt {i}: you are a helpful assistant for tenant number {i}. " * 3
               for i in range(4)]
    for round_ in range(3):
        for system in systems:
            r = _generate(dp_server, system + f"Question {round_}?",
                          {"temperature": 0, "max_new_tokens": 2})
            meta = r.json()["meta_info"]
            if round_:  # the prefix is cached on the replica it is routed to again
                assert meta["cached_tokens"] >= 0.8 * meta["prompt_tokens"], meta
    replicas = _replicas(dp_server)
    assert all(r["cache_hit_rate"] > 0 and r["cached_kv_tokens"] > 0 for r in replicas)


@pytest.fixture
def rr_server(make_tiny_model):
    """Two fresh replicas taking requests in turn, so each surely gets half (under the shared
    server's cache-aware policy, where a request goes depends on what earlier tests sent)."""
    with running_server(make_tiny_model("llama", max_position_embeddings=4096),
                        "--context-length", "4096", "--max-total-tokens", "16384",
                        "--dp-size", "2", "--load-balance-method", "round_robin") as server:
        yield server.url


# Tokens per request: none can finish between the wait below and the kill (four per replica fit
# its 16,384 KV slots). At 900, with decode twice as fast, one replica finished two of its four
# before the poll that saw both running.
LONG = 3600


def test_killed_replica_fails_only_its_requests(rr_server):
    victim = _replicas(rr_server)[1]["scheduler_pid"]
    long = {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True}
    seen: list[dict] = []  # the replicas as last polled

    def victim_holds_all_four() -> bool:  # its four running, the other replica's started
        seen[:] = _replicas(rr_server)
        return (len(seen) == 2 and seen[1]["num_running_reqs"] == 4
                and seen[0]["num_running_reqs"] > 0)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_generate, rr_server, f"{PROMPTS[i % 4]} {i}", long)
                   for i in range(8)]
        _wait(victim_holds_all_four, "the victim running all four of its requests")
        at_kill = list(seen)
        assert at_kill[1]["scheduler_pid"] == victim, at_kill
        os.kill(victim, signal.SIGKILL)
        answers = [f.result(timeout=CLIENT_TIMEOUT_S) for f in futures]
    codes = [a.status_code for a in answers]
    context = f"status codes {codes}; replicas when killed: {at_kill}"
    ok = [a for a in answers if a.status_code == 200]
    failed = [a for a in answers if a.status_code != 200]
    # Round robin put four requests on each replica; those of the killed one were all in flight.
    assert len(ok) == 4 and len(failed) == 4, context
    for a in ok:
        assert a.json()["meta_info"]["completion_tokens"] == LONG, context
    for a in failed:
        assert a.status_code == 503, context
        assert "scheduler process died" in a.json()["error"]["message"], context
    assert _generate(rr_server, PROMPTS[0]).status_code == 200  # the other replica serves
    _wait(lambda: httpx.get(rr_server + "/get_server_info", timeout=CLIENT_TIMEOUT_S).json()
          .get("replicas_serving") == 2, "the killed replica restarted")
    assert _replicas(rr_server)[1]["scheduler_pid"] != victim


def _wait(check, what: str, timeout_s: float = CLIENT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")

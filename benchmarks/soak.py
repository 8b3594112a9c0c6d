"""Soak test of `arborlm serve`: many concurrent clients for a fixed time, one engine crash.

Starts a real server (`tests/server/server_process.py`; the tiny test model unless
`--model-path`), then runs `--clients` asyncio clients for `--duration` seconds over one
`httpx.AsyncClient`. Each client loops: it picks uniformly among the native `/generate`,
`/v1/completions` and `/v1/chat/completions`, streaming or not, with a random prompt and 1-64
new tokens; 20% of the streams are dropped after their first chunk (a client that goes away),
and 5% of the requests are hostile bodies (non-finite numbers, a seed over 64 bits, a lone
surrogate, a broken regex, a huge stop string, negative or mistyped fields) that must get a 400.
Halfway through, the scheduler process is killed with SIGKILL; the server must replace it.

At the end it prints requests sent / completed / errored by reason / dropped on purpose /
**lost** (no answer at all: a timeout, a reset with nothing, a stream that ended without a
final chunk or an error event), latency percentiles of completed requests, the scheduler's RSS
(the first one at start and at the kill, the replacement right after the restart and at the
end), the time from the kill to the first 200 of a request sent after it, and, once the server
is idle, whether `available_kv_tokens + cached_kv_tokens == max_total_num_tokens`. Exits 1 when
a request was lost, a hostile body was not refused with a 400, a good one got a 4xx or a 500,
the engine was not replaced, or the KV pool leaked. Not run in CI; it is not a throughput
benchmark (the clients do not pace themselves, except after a 503 with `Retry-After`, which
they honour up to 2 s).

    python benchmarks/soak.py --clients 20 --duration 60
    python benchmarks/soak.py --clients 200 --duration 600 \\
        --server-args="--max-running-requests 64 --max-queued-requests 96"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.server.server_process import running_server  # noqa: E402

ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
DISCONNECT_SHARE = 0.2  # of streams, dropped after their first chunk
BAD_SHARE = 0.05  # of requests, a hostile body
REQUEST_TIMEOUT_S = 120.0  # no answer by then: lost
MAX_REQUESTS_PER_CLIENT = 1_000_000  # each client's loop is bounded in count, not only time
MAX_BACKOFF_S = 2.0  # Retry-After is honoured up to this, so that clients see the restart
IDLE_TIMEOUT_S = 120.0  # after the load, how long the server may take to drain
RESTART_TIMEOUT_S = 120.0  # how long the replacement scheduler may take to appear
WORDS = ("the cat sat on a mat while seven quiet rivers ran north past old stone towers and "
         "nobody asked why the lamps were green").split()

# Hostile bodies, as raw JSON text (NaN, Infinity and lone-surrogate escapes are not what a
# JSON encoder writes): (route, body). Every one must be answered 400.
HUGE_STOP = "x" * 100_000
BAD_BODIES: list[tuple[str, str]] = [
    ("/generate", '{"text": "hi", "sampling_params": {"temperature": NaN}}'),
    ("/generate", '{"text": "hi", "sampling_params": {"top_p": Infinity}, "stream": true}'),
    ("/v1/completions", '{"model": "m", "prompt": "hi", "temperature": Infinity}'),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                             '"temperature": -Infinity}'),
    ("/generate", json.dumps({"text": "hi", "sampling_params": {"sampling_seed": 2**70}})),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "seed": 2**70, "stream": True})),
    ("/generate", '{"text": "\\ud800 lone", "sampling_params": {"max_new_tokens": 4}}'),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", '
                             '"content": "x\\udfff"}], "stream": true}'),
    ("/generate", '{"text": "hi", "sampling_params": {"stop_regex": "(["}}'),
    ("/generate", '{"text": "hi", "sampling_params": {"stop_regex": ["ok", "(["]}, '
                  '"stream": true}'),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "stop": HUGE_STOP})),
    ("/generate", json.dumps({"text": "hi", "sampling_params": {"stop": [HUGE_STOP]}})),
    ("/generate", '{"text": "hi", "sampling_params": {"max_new_tokens": -1}}'),
    ("/v1/completions", '{"model": "m", "prompt": "hi", "max_tokens": -5}'),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                             '"max_tokens": -1, "stream": true}'),
    ("/generate", '{"text": 5}'),
    ("/generate", '{"text": "hi", "sampling_params": {"max_new_tokens": "8"}}'),
    ("/v1/completions", '{"model": "m", "prompt": "hi", "max_tokens": "10"}'),
    ("/v1/chat/completions", '{"model": "m", "messages": "hi"}'),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                             '"n": "two"}'),
    ("/generate", '[1, 2, 3]'),
    ("/v1/completions", '{"model": "m", "prompt": "hi", "temperature": 1e999}'),
]


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    dropped: int = 0  # streams closed on purpose after the first chunk
    errored: Counter = field(default_factory=Counter)  # reason -> count
    lost: Counter = field(default_factory=Counter)  # reason -> count
    failures: Counter = field(default_factory=Counter)  # wrong answers -> count
    latencies: list[float] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> one example
    kill_time: float | None = None
    first_200_after_kill: float | None = None

    def note(self, bucket: Counter, reason: str, example: str = "") -> None:
        bucket[reason] += 1
        self.examples.setdefault(reason, example[:300])


# --- requests ----------------------------------------------------------------------------------


def _prompt(rng: random.Random, max_chars: int) -> str:
    n = int(2 ** rng.uniform(0, 8))  # 1 to 256 words, log-uniform
    return " ".join(rng.choice(WORDS) for _ in range(n))[:max_chars]


def _good_body(route: str, rng: random.Random, stream: bool, max_chars: int) -> dict[str, Any]:
    tokens = rng.randint(1, 64)
    temperature = rng.choice([0.0, 0.7, 1.0])
    prompt = _prompt(rng, max_chars)
    if route == "/generate":
        return {"text": prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": tokens, "temperature": temperature}}
    body: dict[str, Any] = {"model": "m", "max_tokens": tokens, "temperature": temperature,
                            "stream": stream}
    if route == "/v1/completions":
        return {**body, "prompt": prompt}
    return {**body, "messages": [{"role": "user", "content": prompt}]}


def error_class(body: Any) -> str:
    """What an error body says, in a word: engine restarts and overloads by name, else its
    OpenAI code or the start of its message."""
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    message = str(err.get("message", body)).lower()
    for needle, label in (("engine restarting", "engine restarting"),
                          ("overloaded", "overloaded"), ("not running", "engine unavailable"),
                          ("not responding", "engine not responding")):
        if needle in message:
            return label
    code = err.get("code")
    return code if isinstance(code, str) else message[:40]


def error_reason(status: int, body: Any) -> str:
    return f"{status} {error_class(body)}"


def _is_final(route: str, event: dict[str, Any]) -> bool:
    if route == "/generate":
        return (event.get("meta_info") or {}).get("finish_reason") is not None
    return any(c.get("finish_reason") is not None for c in event.get("choices") or [])


async def _read_stream(response: httpx.Response, route: str, drop: bool,
                       tally: Tally) -> str:
    """"completed", "dropped", "errored" (noted) or "lost" (noted)."""
    final = done = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            tally.note(tally.errored, f"error event in stream: {error_class(event)}", data)
            return "errored"
        if drop:
            return "dropped"
        final = final or _is_final(route, event)
    if final and done:
        return "completed"
    tally.note(tally.lost, "stream ended without a final chunk or an error", route)
    return "lost"


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                      max_chars: int) -> float:
    """Send one request and file its outcome; the seconds to wait before the next one."""
    bad = rng.random() < BAD_SHARE
    if bad:
        route, raw = rng.choice(BAD_BODIES)
        stream = '"stream": true' in raw
        content = raw.encode()
    else:
        route, stream = rng.choice(ROUTES), rng.random() < 0.5
        content = json.dumps(_good_body(route, rng, stream, max_chars)).encode()
    drop = stream and not bad and rng.random() < DISCONNECT_SHARE
    start = time.monotonic()
    tally.sent += 1
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with client.stream("POST", route, content=content,
                                     headers={"Content-Type": "application/json"}) as response:
                status = response.status_code
                if status == 200 and tally.kill_time is not None and start > tally.kill_time \
                        and tally.first_200_after_kill is None:
                    tally.first_200_after_kill = time.monotonic() - tally.kill_time
                if bad:
                    await response.aread()
                    _file_bad(tally, route, raw, status, response.text)
                    return 0.0
                if status != 200:
                    await response.aread()
                    return _file_error(tally, route, status, response)
                if stream:
                    outcome = await _read_stream(response, route, drop, tally)
                else:
                    outcome = _check_body(route, json.loads(await response.aread()), tally)
    except (TimeoutError, httpx.TimeoutException) as e:
        tally.note(tally.lost, f"timeout ({type(e).__name__})", route)
        return 0.0
    except httpx.HTTPError as e:
        tally.note(tally.lost, f"transport error ({type(e).__name__})", f"{route}: {e!r}")
        return 0.0
    except ValueError as e:  # a body or an event that is not JSON
        tally.note(tally.failures, "an answer that is not JSON", f"{route}: {e!r}")
        return 0.0
    if outcome == "completed":
        tally.completed += 1
        tally.latencies.append(time.monotonic() - start)
    elif outcome == "dropped":
        tally.dropped += 1
    return 0.0


def _file_bad(tally: Tally, route: str, raw: str, status: int, text: str) -> None:
    if status == 400:
        tally.note(tally.errored, "400 bad input (on purpose)")
    else:
        tally.note(tally.failures, f"hostile body answered {status}",
                   f"{route} {raw[:120]} -> {text[:150]}")


def _file_error(tally: Tally, route: str, status: int, response: httpx.Response) -> float:
    try:
        body = response.json()
    except ValueError:
        body = response.text
    reason = error_reason(status, body)
    tally.note(tally.errored, reason, f"{route}: {response.text[:200]}")
    if status != 503 or "Retry-After" not in response.headers:
        tally.note(tally.failures, f"good request answered {reason}",
                   f"{route}: {response.text[:200]}")
        return 0.0
    return float(response.headers["Retry-After"])


def _check_body(route: str, body: Any, tally: Tally) -> str:
    ok = isinstance(body, dict) and ("text" in body if route == "/generate" else
                                     bool(body.get("choices")))
    if not ok:
        tally.note(tally.failures, "a 200 without a result", f"{route}: {str(body)[:200]}")
        return "failed"
    return "completed"


async def client_loop(client: httpx.AsyncClient, seed: int, deadline: float, tally: Tally,
                      max_chars: int) -> None:
    rng = random.Random(seed)
    for _ in range(MAX_REQUESTS_PER_CLIENT):
        if time.monotonic() >= deadline:
            return
        pause = await one_request(client, rng, tally, max_chars)
        if pause:  # a 503 with Retry-After: back off, jittered, at most MAX_BACKOFF_S
            wait = min(pause, MAX_BACKOFF_S) * rng.uniform(0.5, 1.0)
            await asyncio.sleep(max(0.0, min(wait, deadline - time.monotonic())))


# --- the engine: kill, restart, idle -----------------------------------------------------------


async def server_info(client: httpx.AsyncClient) -> dict[str, Any] | None:
    try:
        r = await client.get("/get_server_info", timeout=30)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


async def kill_and_watch(client: httpx.AsyncClient, at: float, tally: Tally,
                         figures: dict[str, Any]) -> None:
    """At `at`, SIGKILL the scheduler; then note its replacement's pid, RSS and restart time."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    info = await server_info(client)
    assert info is not None, "no server info before the kill"
    old = info["engine_pids"]["scheduler"]
    assert old == info["scheduler_pid"], (old, info["scheduler_pid"])
    figures["rss_old_at_kill"] = rss_mib(old)
    print(f"killing the scheduler, pid {old} (RSS {figures['rss_old_at_kill']:.1f} MiB)",
          flush=True)
    os.kill(old, signal.SIGKILL)
    tally.kill_time = time.monotonic()
    deadline = tally.kill_time + RESTART_TIMEOUT_S
    while time.monotonic() < deadline:
        info = await server_info(client)
        if info is not None and info["scheduler_pid"] != old:
            figures["new_pid"] = info["scheduler_pid"]
            figures["restart_s"] = time.monotonic() - tally.kill_time
            figures["rss_new_after_restart"] = rss_mib(figures["new_pid"])
            print(f"replacement scheduler pid {figures['new_pid']} after "
                  f"{figures['restart_s']:.2f} s", flush=True)
            return
        await asyncio.sleep(0.05)
    figures["new_pid"] = None


async def wait_idle(client: httpx.AsyncClient) -> dict[str, Any] | None:
    """Server info once nothing runs, waits or is in flight (polled), or None on timeout."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        info = await server_info(client)
        if info is not None and not (info["num_running_reqs"] or info["num_waiting_reqs"]
                                     or info["num_sequences_in_flight"]):
            return info
        await asyncio.sleep(0.1)
    return None


async def progress(tally: Tally, figures: dict[str, Any], start: float, every_s: float) -> None:
    """A line of running totals and the current scheduler's RSS every `every_s` seconds."""
    while True:
        await asyncio.sleep(every_s)
        pid = figures.get("new_pid") or figures["old_pid"]
        try:
            rss = f"{rss_mib(pid):.0f} MiB"
        except psutil.Error:
            rss = "-"
        print(f"  {time.monotonic() - start:6.0f} s: sent {tally.sent}, completed "
              f"{tally.completed}, errored {sum(tally.errored.values())}, dropped "
              f"{tally.dropped}, lost {sum(tally.lost.values())}; scheduler {pid} RSS {rss}",
              flush=True)


# --- the run -----------------------------------------------------------------------------------


async def soak(url: str, args: argparse.Namespace) -> tuple[Tally, dict[str, Any]]:
    tally, figures = Tally(), {}
    limits = httpx.Limits(max_connections=args.clients + 8,
                          max_keepalive_connections=args.clients + 8)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client, \
            httpx.AsyncClient(base_url=url, timeout=timeout) as control:
        info = await server_info(control)
        assert info is not None
        figures["old_pid"] = info["scheduler_pid"]
        figures["rss_old_at_start"] = rss_mib(figures["old_pid"])
        context = (await control.get("/get_model_info")).json()["context_length"]
        max_chars = max(16, min(1024, context // 2))
        print(f"scheduler pid {figures['old_pid']} (RSS {figures['rss_old_at_start']:.1f} MiB), "
              f"context {context}, {args.clients} clients for {args.duration:.0f} s", flush=True)
        start = time.monotonic()
        deadline = start + args.duration
        killer = asyncio.create_task(kill_and_watch(control, start + args.duration * args.kill_at,
                                                    tally, figures))
        ticker = asyncio.create_task(progress(tally, figures, start,
                                                max(5.0, args.duration / 20)))
        loops = [client_loop(client, args.seed * 100_003 + i, deadline, tally, max_chars)
                 for i in range(args.clients)]
        await asyncio.gather(*loops)
        await killer
        ticker.cancel()
        figures["load_s"] = time.monotonic() - start
        figures["idle_info"] = await wait_idle(control)
        if figures.get("new_pid"):
            figures["rss_new_at_end"] = rss_mib(figures["new_pid"])
    return tally, figures


def report(tally: Tally, figures: dict[str, Any]) -> bool:
    """Print the figures; whether the run passed."""
    lat = sorted(tally.latencies)
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")
    print(f"\nload ran {figures['load_s']:.1f} s")
    print(f"sent {tally.sent}, completed {tally.completed}, "
          f"errored {sum(tally.errored.values())}, dropped on purpose {tally.dropped}, "
          f"lost {sum(tally.lost.values())}")
    for title, bucket in (("errored", tally.errored), ("LOST", tally.lost),
                          ("FAILURES", tally.failures)):
        for reason, count in bucket.most_common():
            example = tally.examples.get(reason, "")
            print(f"  {title}: {reason}: {count}" + (f"   e.g. {example}" if example and
                                                     title != "errored" else ""))
    if lat:
        print(f"latency of completed requests: p50 {pct(0.5) * 1e3:.0f} ms, "
              f"p99 {pct(0.99) * 1e3:.0f} ms, mean {statistics.fmean(lat) * 1e3:.0f} ms")
    print(f"scheduler RSS (MiB): first pid {figures['old_pid']}: "
          f"{figures['rss_old_at_start']:.1f} at start, "
          f"{figures.get('rss_old_at_kill', float('nan')):.1f} at the kill; "
          f"replacement pid {figures.get('new_pid')}: "
          f"{figures.get('rss_new_after_restart', float('nan')):.1f} right after the restart, "
          f"{figures.get('rss_new_at_end', float('nan')):.1f} at the end")
    restarted = bool(figures.get("new_pid"))
    first = tally.first_200_after_kill
    print(f"kill -> replacement scheduler: {figures.get('restart_s', float('nan')):.2f} s; "
          f"kill -> first 200 of a request sent after it: "
          + (f"{first:.2f} s" if first is not None else "none"))
    info = figures["idle_info"]
    kv_ok = False
    if info is None:
        print(f"the server did not go idle within {IDLE_TIMEOUT_S:.0f} s")
    else:
        free, cached, total = (info["available_kv_tokens"], info["cached_kv_tokens"],
                               info["max_total_num_tokens"])
        kv_ok = free + cached == total
        print(f"idle KV: available {free} + cached {cached} = {free + cached}, "
              f"max_total_num_tokens {total}: {'OK' if kv_ok else 'LEAK'}; "
              f"engine_restarts {info['engine_restarts']}")
        restarted = restarted and info["engine_restarts"] == 1
    passed = not tally.lost and not tally.failures and kv_ok and restarted \
        and first is not None
    print("PASS" if passed else "FAIL")
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--model-path", default=None,
                        help="default: the tiny test model (tiny_model('llama'))")
    parser.add_argument("--server-args", default="",
                        help="extra server flags, one string: --server-args='--max-running-"
                             "requests 64 --max-queued-requests 96'")
    parser.add_argument("--kill-at", type=float, default=0.5,
                        help="when to kill the scheduler, as a fraction of --duration")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = args.model_path
    if model is None:
        from arborlm.runtime.models.factory import tiny_model

        model = tiny_model("llama")
    with running_server(model, *shlex.split(args.server_args)) as server:
        print(f"server {server.url}, pid {server.proc.pid}, model {model}, "
              f"flags {args.server_args or '(none)'}", flush=True)
        tally, figures = asyncio.run(soak(server.url, args))
        passed = report(tally, figures)
    print("the server stopped cleanly (exit 0, no child left)")
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()

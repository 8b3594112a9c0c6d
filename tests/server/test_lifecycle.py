"""The server's life: `--help`, the API process's imports, the ready line, and SIGTERM —
stop accepting, let in-flight requests finish for at most `--drain-timeout`, exit 0 and leave
no child process behind."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from arborlm.server.cli import serve_main
from tests.server.server_process import ServerProcess

REQUIRED_FLAGS = [
    "--model-path", "--host", "--port", "--api-key", "--served-model-name", "--chat-template",
    "--engine-mode", "--dtype", "--max-total-tokens", "--max-running-requests",
    "--chunked-prefill-size", "--schedule-policy", "--disable-radix-cache",
    "--attention-backend", "--page-size", "--random-seed", "--log-level",
]
MODEL_CODE = ("arborlm.runtime.models.llama", "arborlm.runtime.model_runner",
              "arborlm.runtime.scheduler", "arborlm.runtime.layers", "arborlm.runtime.attention")


def test_help_documents_each_flag_once(capsys):
    with pytest.raises(SystemExit) as info:
        serve_main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    listed = [line.split()[0].rstrip(",") for line in text.splitlines()
              if line.startswith("  --")]
    assert len(listed) == len(set(listed))
    for flag in REQUIRED_FLAGS:
        assert listed.count(flag) == 1, flag


def test_api_process_imports_no_model_code(make_tiny_model):
    """In multi-process mode the API process holds the app and the tokenizer only."""
    code = (
        "import sys\n"
        "import arborlm.server.cli, arborlm.server.app, arborlm.runtime.engine\n"
        "import arborlm.runtime.multiprocess_client\n"
        "from arborlm.runtime.config import EngineArgs\n"
        "from arborlm.runtime.tokenizer_utils import load_tokenizer\n"
        f"config = EngineArgs(model_path={str(make_tiny_model('llama'))!r}).resolve()\n"
        "load_tokenizer(config.tokenizer_path)\n"
        f"print([m for m in sys.modules if m.startswith({MODEL_CODE!r})])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


# The drain test's sizes come from the measured speed of one sequence (`_seconds_per_token`):
# the short request needs about a third of the drain, the long one at least ten drains.
DRAIN_S = 6.0
SEQ_TOKENS = 1900  # tokens of each of the long request's sequences (context 2048)
CLIENT_TIMEOUT_S = 600.0  # an HTTP read that takes longer has hung


def _stream(url: str, body: dict, result: dict) -> None:
    events = []
    try:
        with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        result.setdefault("first", time.monotonic())
    except httpx.HTTPError as e:
        result["error"] = e
    result["done"] = time.monotonic()
    result["events"] = events


def _poll(what: str, check, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {deadline_s:.0f} s"
        time.sleep(0.01)


def _generate_s(url: str, tokens: int) -> float:
    body = {"text": "warm", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
    start = time.monotonic()
    r = httpx.post(url + "/generate", json=body, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return time.monotonic() - start


def _seconds_per_token(url: str) -> tuple[float, float, float]:
    """(low, high, request) estimates of one sequence's time per token, and the time of a short
    request: `low` leaves out the fixed cost of a request (a difference of two lengths),
    `high` includes it."""
    _generate_s(url, 8)  # first-request costs out of the way
    base = _generate_s(url, 16)
    long = _generate_s(url, 16 + 256)
    return max((long - base) / 256, 1e-5), long / (16 + 256), base


def _refused(url: str) -> bool:
    """Whether a new connection goes unserved: refused, or (one the kernel accepted into the
    listening socket's backlog just before the server closed it) reset before any answer."""
    try:
        httpx.get(url + "/health", timeout=CLIENT_TIMEOUT_S)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    return False


def test_sigterm_drains_in_flight_requests_for_a_bounded_time(make_tiny_model):
    """Regression (a loaded machine): the wait for the first stream event was a fixed 60 s, and
    the long request had to outlast the drain by a guessed margin; both now follow from the
    measured speed of this server."""
    server = ServerProcess(make_tiny_model("llama"), [
        "--context-length", "2048", "--max-running-requests", "1",
        "--drain-timeout", str(DRAIN_S)])
    try:
        url = server.wait_ready()
        assert server.log_text().count("ArborLM server ready at") == 1
        low, high, request_s = _seconds_per_token(url)
        print(f"\nper token {low * 1e3:.2f}-{high * 1e3:.2f} ms, a request {request_s:.2f} s")
        short_tokens = max(1, min(SEQ_TOKENS, int(DRAIN_S / 3 / high)))
        n = -(-int(10 * DRAIN_S / low) // SEQ_TOKENS)  # sequences, one at a time
        assert n <= 1000, f"{low * 1e3:.3f} ms a token: too fast for a drain of {DRAIN_S} s"
        # Deadlines: generous multiples of the work measured (a loaded machine slows both).
        wait_s = 60 + 50 * (request_s + short_tokens * high)
        short, long = {}, {}
        short_body = {"text": "short", "sampling_params": {"max_new_tokens": short_tokens,
                                                           "ignore_eos": True}}
        long_body = {"text": ["long"] * n, "sampling_params": {"max_new_tokens": SEQ_TOKENS,
                                                               "ignore_eos": True}}
        threads = [threading.Thread(target=_stream, args=(url, short_body, short))]
        threads[0].start()
        _poll("the short stream's first event", lambda: "first" in short or "events" in short,
              wait_s)
        threads.append(threading.Thread(target=_stream, args=(url, long_body, long)))
        threads[1].start()
        _poll("the long request queued behind the short one", lambda: httpx.get(
            url + "/get_server_info", timeout=CLIENT_TIMEOUT_S).json()["num_waiting_reqs"] >= 1,
            wait_s)
        terminated = time.monotonic()
        server.proc.send_signal(15)
        _poll("new connections refused while draining", lambda: _refused(url), wait_s)
        code = server.proc.wait(timeout=DRAIN_S + wait_s)
        took = time.monotonic() - terminated
        for t in threads:
            t.join(timeout=wait_s)
            assert not t.is_alive(), "a request outlived the server"
        assert code == 0, server.log_text()[-3000:]
        server.assert_no_children_left()
        assert short["done"] > terminated, "the short request was not in flight at SIGTERM"
        assert short["events"][-1] == "[DONE]"  # finished during the drain
        final = json.loads(short["events"][-2])
        assert final["meta_info"]["finish_reason"] == {"type": "length",
                                                       "length": short_tokens}
        # The long request was cut off (connection closed, or an error event once the engine
        # stopped) when the drain time ran out: its sequences did not all finish.
        parsed = [json.loads(e) for e in long["events"] if e != "[DONE]"]
        assert sum(1 for e in parsed if (e.get("meta_info") or {}).get("finish_reason")) < n
        assert DRAIN_S <= took < DRAIN_S + wait_s
    finally:
        server.cleanup()

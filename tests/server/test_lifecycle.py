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


def _stream(url: str, body: dict, result: dict) -> None:
    events = []
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        result.setdefault("first", time.monotonic())
    except httpx.HTTPError as e:
        result["error"] = e
    result["events"] = events


def _started(result: dict, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while "first" not in result and "events" not in result:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.02)


def test_sigterm_drains_in_flight_requests_for_a_bounded_time(make_tiny_model):
    # The long request's four sequences, one at a time, must outlast the 3 s drain: the model's
    # own decode path (~1 ms a token here); the fused C++ step could finish them in time.
    server = ServerProcess(make_tiny_model("llama"), [
        "--context-length", "1024", "--max-running-requests", "1", "--drain-timeout", "3",
        "--disable-fused-decode"])
    try:
        url = server.wait_ready()
        assert server.log_text().count("ArborLM server ready at") == 1
        short, long = {}, {}
        short_body = {"text": "short", "sampling_params": {"max_new_tokens": 150,
                                                           "ignore_eos": True}}
        long_body = {"text": "long", "sampling_params": {"max_new_tokens": 1000,
                                                         "ignore_eos": True, "n": 4}}
        threads = [threading.Thread(target=_stream, args=(url, short_body, short))]
        threads[0].start()
        _started(short)
        threads.append(threading.Thread(target=_stream, args=(url, long_body, long)))
        threads[1].start()
        while httpx.get(url + "/get_server_info").json()["num_waiting_reqs"] < 1:
            time.sleep(0.01)  # the long request is queued behind the short one
        terminated = time.monotonic()
        server.proc.send_signal(15)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)  # no new connections while draining
        code = server.proc.wait(timeout=60)
        took = time.monotonic() - terminated
        for t in threads:
            t.join(timeout=30)
        assert code == 0, server.log_text()[-3000:]
        server.assert_no_children_left()
        assert short["events"][-1] == "[DONE]"  # finished during the drain
        final = json.loads(short["events"][-2])
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 150}
        # The long request was cut off (connection closed, or an error event once the engine
        # stopped) when the drain time ran out: its four sequences did not all finish.
        parsed = [json.loads(e) for e in long["events"] if e != "[DONE]"]
        assert sum(1 for e in parsed if (e.get("meta_info") or {}).get("finish_reason")) < 4
        assert 3 <= took < 30
    finally:
        server.cleanup()

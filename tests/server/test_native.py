"""The native API against a real server: every route, docs/api.md's response shapes, streaming,
logprobs, `n`, the SGLang frontend's `select` sequence, aborts, and clients that disconnect."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from tests.server.server_process import running_server

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_new_tokens": 8}
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
             "e2e_latency"}
LOGPROB_KEYS = {"input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                "output_top_logprobs"}


@pytest.fixture(scope="module")
def server(make_tiny_model):
    with running_server(make_tiny_model("llama"), "--context-length", "1024",
                        "--max-total-tokens", "16384", "--debug-integrity") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def generate(http: httpx.Client, **body) -> dict | list:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(lines) -> list:
    """Parsed `data:` payloads of an SSE body, with "[DONE]" kept as a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def stream_generate(http: httpx.Client, **body) -> list:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def wait_idle(http: httpx.Client, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = http.get("/get_server_info").json()
        if not info["num_running_reqs"] and not info["num_waiting_reqs"] \
                and not info["num_sequences_in_flight"]:
            return info
        time.sleep(0.1)
    raise AssertionError(f"server not idle after {timeout} s: {info}")


def test_generate_returns_the_native_shape(http):
    out = generate(http, text=PROMPT, sampling_params=GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) == META_KEYS
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["prompt_tokens"] == len(http.post("/tokenize", json={"prompt": PROMPT})
                                        .json()["tokens"])
    assert isinstance(out["text"], str) and meta["e2e_latency"] > 0


def test_text_and_input_ids_give_the_same_greedy_output(http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = generate(http, text=PROMPT, sampling_params=GREEDY)
    by_ids = generate(http, input_ids=ids, sampling_params=GREEDY)
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["text"] == by_text["text"]


def test_batch_and_n_return_a_list_in_prompt_major_order(http):
    outs = generate(http, text=["a b c", "x y z"], rid=["r1", "r2"],
                    sampling_params={"max_new_tokens": 3, "n": 2, "temperature": 0.8,
                                     "sampling_seed": 5})
    assert [o["meta_info"]["id"] for o in outs] == ["r1-0", "r1-1", "r2-0", "r2-1"]
    assert all(len(o["output_ids"]) == 3 for o in outs)
    single_n = generate(http, text="a b c", sampling_params={"max_new_tokens": 2, "n": 2})
    assert isinstance(single_n, list) and len(single_n) == 2
    r = http.post("/generate", json={"text": ["a", "b"], "rid": ["same", "same"]})
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]


def test_max_new_tokens_zero_is_a_prefill(http):
    out = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["prompt_tokens"] > 0


def test_logprobs_with_text(http):
    out = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 4, "temperature": 0},
                   return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                   return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert LOGPROB_KEYS <= set(meta)
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"] and len(outputs) == 4
    assert inputs[0][0] is None and inputs[0][2] == "<s>"
    assert [e[1] for e in outputs] == out["output_ids"]
    for lp, tid, text in inputs[1:] + outputs:
        assert lp <= 0 and isinstance(tid, int) and isinstance(text, str)
    for (lp, tid, _), top in zip(outputs, meta["output_top_logprobs"]):
        assert len(top) == 2 and top[0][1] == tid  # greedy picks the most likely token
        assert top[0][0] == pytest.approx(lp, abs=1e-4) and top[0][0] >= top[1][0]
    plain = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 1})
    assert not LOGPROB_KEYS & set(plain["meta_info"])


def test_streaming_is_cumulative_and_ends_with_done(http):
    full = generate(http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 12},
                    return_logprob=True)
    events = stream_generate(http, text=PROMPT, return_logprob=True,
                             sampling_params={**GREEDY, "max_new_tokens": 12})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1 and all("index" not in c for c in chunks)
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"]
    streamed = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in streamed] == full["output_ids"]


def test_streaming_a_batch_tags_each_event_with_its_index(http):
    events = stream_generate(http, text=["one", "two"],
                             sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert events[-1] == "[DONE]"
    finals = {c["index"]: c for c in events[:-1] if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]
    assert finals[0]["output_ids"] == generate(http, text="one", sampling_params={
        "max_new_tokens": 3, "temperature": 0})["output_ids"]


def test_sglang_frontend_select_sequence(http):
    """`select`: prefill the prompt, then score prompt + each choice in one batch."""
    prompt = "Q: What color is the sky? A: The sky is"
    choices = [" blue", " green", " a color"]
    warm = generate(http, text=prompt, sampling_params={"max_new_tokens": 0})
    prompt_len = warm["meta_info"]["prompt_tokens"]
    start = max(prompt_len - 2, 0)
    outs = generate(http, text=[prompt + c for c in choices],
                    sampling_params={"max_new_tokens": 0, "temperature": 0},
                    return_logprob=True, logprob_start_len=start, return_text_in_logprobs=True)
    assert len(outs) == len(choices)
    scores = []
    for out in outs:
        meta = out["meta_info"]
        entries = meta["input_token_logprobs"]
        assert len(entries) == meta["prompt_tokens"] - start
        assert all(isinstance(e[0], float) and isinstance(e[2], str) for e in entries)
        assert meta["output_token_logprobs"] == [] and out["output_ids"] == []
        # the warmed prefix was reused, up to the position whose logits score token `start`
        assert meta["cached_tokens"] >= start - 1
        scores.append(sum(e[0] for e in entries) / len(entries))
    for out, choice in zip(outs, choices):
        scored = "".join(e[2] for e in out["meta_info"]["input_token_logprobs"])
        assert scored.endswith(choice)  # the scored tail covers the whole choice
    assert len(set(scores)) == len(scores)


def test_model_and_server_info(http, server):
    for route in ("/get_model_info", "/model_info"):
        info = http.get(route).json()
        assert info["is_generation"] is True
        assert info["model_path"] and info["tokenizer_path"]
        assert info["context_length"] == 1024
    for route in ("/get_server_info", "/server_info"):
        info = http.get(route).json()
        for key in ("max_total_num_tokens", "num_running_reqs", "num_waiting_reqs",
                    "cache_hit_rate", "context_length", "max_running_requests", "version"):
            assert key in info, key
        assert info["max_total_num_tokens"] == 16384
        assert info["api_key"] is None


def test_health_routes(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200


def test_flush_cache(http):
    text = "flush me " * 8
    generate(http, text=text, sampling_params={"max_new_tokens": 0})
    assert generate(http, text=text, sampling_params={"max_new_tokens": 0}
                    )["meta_info"]["cached_tokens"] > 0
    wait_idle(http)
    r = http.post("/flush_cache", json={"empty_cache": True})
    assert r.status_code == 200 and r.json()["success"] is True
    assert generate(http, text=text, sampling_params={"max_new_tokens": 0}
                    )["meta_info"]["cached_tokens"] == 0
    with http.stream("POST", "/generate", json={
            "text": "busy", "stream": True, "rid": "flush-busy",
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}) as r:
        lines = r.iter_lines()  # kept referenced: dropping it would close the stream
        next(lines)
        busy = http.post("/flush_cache")
        assert busy.status_code == 400 and "pending" in busy.json()["error"]["message"]
        http.post("/abort_request", json={"rid": "flush-busy"})
    wait_idle(http)
    assert http.get("/flush_cache").status_code == 200


def test_abort_request_ends_streams_with_abort(http):
    body = {"text": "abort", "rid": "ab", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "n": 2}}
    with http.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        assert http.post("/abort_request", json={"rid": "ab"}).json() == {"success": True}
        events = sse_events(lines)
    assert events[-1] == "[DONE]"
    finals = [e for e in events[:-1] if e["meta_info"]["finish_reason"]]
    assert sorted(e["index"] for e in finals) == [0, 1]
    assert all(e["meta_info"]["finish_reason"]["type"] == "abort" for e in finals)
    assert all(e["meta_info"]["completion_tokens"] < 1000 for e in finals)
    r = http.post("/abort_request", json={})
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200


def test_a_request_the_engine_fails_is_an_error(http):
    """A rid already in flight: the engine ends the newcomer with a 400 abort."""
    body = {"text": "dup", "rid": "dup", "sampling_params": {"max_new_tokens": 1000,
                                                             "ignore_eos": True}}
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        again = http.post("/generate", json=body)
        assert again.status_code == 400
        assert "duplicate request id" in again.json()["error"]["message"]
        with http.stream("POST", "/generate", json={**body, "stream": True}) as dup:
            assert dup.status_code == 400  # failed before its stream started
        http.post("/abort_request", json={"rid": "dup"})


def test_tokenize_detokenize_round_trip(http):
    one = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert one["count"] == len(one["tokens"]) and one["max_model_len"] == 1024
    assert one["tokens"][0] == 1  # BOS
    bare = http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False})
    assert bare.json()["tokens"] == one["tokens"][1:]
    many = http.post("/tokenize", json={"prompt": ["a", "bb"]}).json()
    assert many["count"] == [len(t) for t in many["tokens"]]
    text = http.post("/detokenize", json={"tokens": one["tokens"][1:]}).json()["text"]
    assert text.strip() == "hello world"
    texts = http.post("/detokenize", json={"tokens": [t[1:] for t in many["tokens"]]}).json()
    assert [t.strip() for t in texts["text"]] == ["a", "bb"]
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_metrics_count_requests_tokens_and_latencies(http):
    stream_generate(http, text="metrics", sampling_params={"max_new_tokens": 5})
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['arborlm:http_requests_total{route="/generate",status="200"}'] >= 1
    assert values['arborlm:requests_total{finish_reason="length"}'] >= 1
    assert values["arborlm:prompt_tokens_total"] > 0
    assert values["arborlm:generation_tokens_total"] >= 5
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert values[f"arborlm:{hist}_count"] > 0, hist
    for gauge in ("num_running_reqs", "num_queue_reqs", "cache_hit_rate"):
        assert f"arborlm:{gauge}" in values, gauge


def _read_some_then_leave(url: str, rng: random.Random, n: int, errors: list) -> None:
    body = {"text": f"storm {rng.random()}", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "n": n}}
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream("POST", "/generate", json=body) as r:
                wanted = rng.randint(1, 6)
                for i, _ in enumerate(r.iter_lines()):
                    if i >= wanted:
                        break
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def _wait_then_leave(url: str) -> None:
    body = {"text": "impatient", "sampling_params": {"max_new_tokens": 1000,
                                                     "ignore_eos": True}}
    with httpx.Client(base_url=url, timeout=0.3) as client:
        with pytest.raises(httpx.TimeoutException):
            client.post("/generate", json=body)


def _aborted(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('arborlm:requests_total{finish_reason="abort"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_clients_that_disconnect_abort_and_leave_the_kv_pool_intact(http, server):
    before = _aborted(http)
    rng = random.Random(0)
    errors: list = []
    streams = [1 + i % 2 for i in range(8)]  # n of each streaming client
    threads = [threading.Thread(target=_read_some_then_leave,
                                args=(server.url, random.Random(i), n, errors))
               for i, n in enumerate(streams)]
    threads += [threading.Thread(target=_wait_then_leave, args=(server.url,)) for _ in range(2)]
    rng.shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    info = wait_idle(http)
    # every sequence of every client was aborted rather than run to its 1000 tokens
    assert _aborted(http) - before == sum(streams) + 2
    assert info["available_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_num_tokens"]
    assert info.get("integrity_ok", True) is True
    assert http.get("/health").status_code == 200
    assert len(generate(http, text=PROMPT, sampling_params=GREEDY)["output_ids"]) == 8

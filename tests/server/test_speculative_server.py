"""Speculative decoding behind the HTTP server (the multi-process runtime): outputs, streamed
or not, equal the in-process engine's plain decoding; `meta_info` carries `spec_verify_ct` and
`spec_accept_length`, `/get_server_info` the average acceptance length and `/metrics` the
draft counters."""

from __future__ import annotations

import re

import httpx
import pytest

from arborlm import Engine
from tests.server.server_process import running_server
from tests.server.test_native import stream_generate, wait_idle

# Prompts that repeat themselves, so prompt lookup finds drafts even on random weights.
PROMPTS = [" ".join(["alpha beta gamma delta"] * 6), "one two three one two three one two"]
PARAMS = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def plain(model) -> list[list[int]]:
    with Engine(model, dtype="float32") as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, [PARAMS] * len(PROMPTS))]


def test_server_speculation_equals_plain_decoding(model, plain):
    with running_server(model, "--dtype", "float32", "--speculative-algorithm", "NGRAM",
                        "--num-continuous-decode-steps", "1", "--debug-integrity") as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/generate", json={"text": PROMPTS, "sampling_params": PARAMS})
        assert r.status_code == 200, r.text
        outs = r.json()
        assert [o["output_ids"] for o in outs] == plain
        verify_ct = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        assert verify_ct > 0
        for o in outs:
            if "spec_verify_ct" in o["meta_info"]:
                assert o["meta_info"]["spec_accept_length"] >= 1.0
        events = stream_generate(http, text=PROMPTS[0], sampling_params=PARAMS)
        assert events[-1] == "[DONE]" and events[-2]["output_ids"] == plain[0]
        info = wait_idle(http)
        assert info["spec_drafts"] >= verify_ct and info["avg_spec_accept_length"] >= 1.0
        metrics = http.get("/metrics").text
        drafts = re.search(r"^arborlm:spec_drafts_total (\S+)$", metrics, re.M)
        assert drafts and float(drafts.group(1)) == info["spec_drafts"]
        assert re.search(r"^arborlm:spec_accepted_tokens_total \S+$", metrics, re.M)
        bad = http.post("/generate", json={"text": "x", "sampling_params": {
            "max_new_tokens": -1}})
        assert bad.status_code == 400


def test_server_standalone_draft_model_equals_plain_decoding(model, plain):
    """STANDALONE in the scheduler process: the model drafting for itself, outputs equal plain
    decoding's and (float32, the same model) every draft token is accepted."""
    with running_server(model, "--dtype", "float32", "--speculative-algorithm", "STANDALONE",
                        "--speculative-draft-model-path", model, "--speculative-num-steps", "3",
                        "--debug-integrity") as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/generate", json={"text": PROMPTS, "sampling_params": PARAMS})
        assert r.status_code == 200, r.text
        outs = r.json()
        assert [o["output_ids"] for o in outs] == plain
        assert all(o["meta_info"]["spec_accept_length"] > 3.0 for o in outs)
        info = wait_idle(http)
        assert info["spec_accepted_tokens"] == info["spec_draft_tokens"] > 0
        assert info.get("integrity_ok", True)

"""`arborlm serve` with no model serves SmolLM2-135M-Instruct, and it answers like the real model.

The server starts without `--model-path` (the README's main command) in the test session's cache,
where the `smollm2_gguf` fixture has put the file through the same fetch, so no second download.
"""

from __future__ import annotations

import httpx


def test_default_server_answers_the_capital_of_france(smollm2_gguf):
    from openai import OpenAI

    from tests.server.server_process import running_server

    with running_server(None) as server:
        info = httpx.get(server.url + "/get_model_info", timeout=30).json()
        assert info["model_path"] == str(smollm2_gguf)
        client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
        reply = client.chat.completions.create(
            model="default", max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        answer = reply.choices[0].message.content
        assert "Paris" in answer, answer
        assert reply.choices[0].finish_reason == "stop", reply
        native = httpx.post(server.url + "/generate", timeout=120, json={
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
        assert "Paris" in native["text"], native

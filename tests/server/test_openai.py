"""The OpenAI-compatible API against a real server, driven by the `openai` client: completions,
chat, streaming with usage, logprobs, `n`, `seed`, `stop`, extensions and OpenAI's errors."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.server_process import running_server

MODEL = "tiny"
CONTEXT = 512
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(make_tiny_model):
    with running_server(make_tiny_model("llama"), "--served-model-name", MODEL,
                        "--context-length", str(CONTEXT)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6,
                                    temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert isinstance(choice.text, str)
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    assert out.usage.prompt_tokens_details.cached_tokens <= out.usage.prompt_tokens


def test_completion_n_and_batch_in_prompt_major_order(client):
    out = client.completions.create(model=MODEL, prompt=["one two", "three four"], n=2,
                                    max_tokens=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy samples agree
    assert out.usage.completion_tokens == 12
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage
               for p in ("one two", "three four")]
    assert out.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)  # once per prompt
    ids = client.completions.create(model=MODEL, prompt=[[1, 70, 71]], max_tokens=2)
    assert ids.usage.prompt_tokens == 3


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0,
                                    logprobs=3, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith("abc")
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset)
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:]):  # after BOS
        assert choice.text[offset:offset + len(token)] == token
    for token, value, top in zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:],
                                 lp.top_logprobs[n_prompt:]):
        assert 1 <= len(top) <= 3
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy = most likely
        assert top.get(token) == pytest.approx(value, abs=1e-4)


def test_completion_stream_with_usage(client):
    full = client.completions.create(model=MODEL, prompt="stream me", max_tokens=10,
                                     temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="stream me", max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_trims_the_output(client):
    full = client.completions.create(model=MODEL, prompt="The cat", max_tokens=20,
                                     temperature=0).choices[0].text
    stop = full[5:8]
    assert stop and stop in full
    out = client.completions.create(model=MODEL, prompt="The cat", max_tokens=20,
                                    temperature=0, stop=[stop]).choices[0]
    assert out.text == full[:full.index(stop)]
    assert out.finish_reason == "stop"
    assert out.model_extra["matched_stop"] == stop


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> list[str]:
        out = client.completions.create(model=MODEL, prompt="Roll", max_tokens=8,
                                        temperature=1.0, n=2, seed=seed)
        return [c.text for c in out.choices]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_chat_completion(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                         temperature=0)
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.usage.completion_tokens <= 5
    # The prompt is the rendered chat template: BOS once, then ChatML turns.
    ids = client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert out.usage.prompt_tokens > ids.usage.prompt_tokens


def test_chat_prompt_has_a_single_bos(client, http):
    rendered = ("<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = http.post("/tokenize", json={"prompt": rendered, "add_special_tokens": False}
                    ).json()["tokens"]
    assert ids.count(1) == 1
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert chat.usage.prompt_tokens == len(ids)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        decoded = bytes(entry.bytes).decode("utf-8", errors="replace")
        assert decoded == entry.token or "\ufffd" in entry.token
    no_top = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                            logprobs=True)
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)


def test_chat_stream_with_usage(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_n_samples(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=3,
                                         temperature=1.0, seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1


def test_extensions_in_extra_body(client):
    out = client.completions.create(
        model=MODEL, prompt="Go", max_tokens=7, temperature=1.0,
        extra_body={"top_k": 1, "min_tokens": 7, "ignore_eos": True, "rid": "ext-1",
                    "repetition_penalty": 1.1})
    assert out.id == "ext-1" and out.usage.completion_tokens == 7
    greedy = client.completions.create(model=MODEL, prompt="Go", max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True,
                                                   "repetition_penalty": 1.1})
    assert out.choices[0].text == greedy.choices[0].text  # top_k=1 is greedy


def test_content_parts_and_response_format_text(client):
    out = client.chat.completions.create(
        model=MODEL, max_tokens=2, response_format={"type": "text"},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}])
    assert out.choices[0].message.role == "assistant"


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": CONTEXT + 1}, "max_tokens"),
    ({"n": 1000}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"logprobs": 50}, "logprobs"),
    ({"prompt": "word " * 600}, "prompt"),
    ({"stop": ["x"] * 100}, "stop"),
    ({"extra_body": {"top_k": 0}}, "top_k"),
    ({"extra_body": {"not_a_field": 1}}, "not_a_field"),
    # regression: echo decoded out-of-vocabulary ids before validation and answered 500
    ({"prompt": [-2147483648], "echo": True}, "prompt"),
])
def test_completion_errors_use_openai_error_body(client, kwargs, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body)
    error = info.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert param in error["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                   "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_chat_errors_use_openai_error_body(client, kwargs, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    error = info.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}


def test_unknown_v1_route_is_an_openai_404(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"

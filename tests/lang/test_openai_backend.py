"""The OpenAI backend against the server's OpenAI-compatible routes, cross-checked with
`RuntimeEndpoint` on the same server (same model, greedy: the same answers)."""

from __future__ import annotations

import pytest

import arborlm.lang as sgl
from arborlm.lang.errors import BackendError
from tests.lang.conftest import GREEDY


@pytest.fixture(scope="module")
def openai_chat(server, endpoint_backend):
    pytest.importorskip("openai")
    name = endpoint_backend.model_info["served_model_name"]
    return sgl.OpenAI(name, base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def openai_completion(server, endpoint_backend):
    pytest.importorskip("openai")
    name = endpoint_backend.model_info["served_model_name"]
    return sgl.OpenAI(name, base_url=server.url + "/v1", is_chat_model=False,
                      chat_template=endpoint_backend.get_chat_template())


@sgl.function
def chat(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6))
    s += sgl.user("More?")
    s += sgl.assistant(sgl.gen("more", max_tokens=4))


def test_chat_gen_matches_the_native_endpoint(openai_chat, endpoint_backend):
    via_openai = chat.run("Hi there", backend=openai_chat, **GREEDY)
    native = chat.run("Hi there", backend=endpoint_backend, **GREEDY)
    assert via_openai.error() is None
    assert via_openai["answer"] == native["answer"]
    assert via_openai["more"] == native["more"]
    assert [m["role"] for m in via_openai.messages()] == ["system", "user", "assistant",
                                                          "user", "assistant"]
    meta = via_openai.get_meta_info("answer")
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["completion_tokens"] == native.get_meta_info("answer")["completion_tokens"]


def test_chat_gen_streams(openai_chat):
    final = chat.run("Stream", backend=openai_chat, **GREEDY)
    state = chat.run("Stream", backend=openai_chat, stream=True, **GREEDY)
    assert "".join(state.text_iter("answer")) == final["answer"]
    assert state.text() == final.text()


@sgl.function
def completion(s):
    s += "Once upon a time"
    s += sgl.gen("story", max_tokens=8)


def test_completion_model_gen_matches_the_native_endpoint(openai_completion, endpoint_backend):
    assert completion.run(backend=openai_completion, **GREEDY)["story"] == \
        completion.run(backend=endpoint_backend, **GREEDY)["story"]


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token_selection",
                                    "unconditional_likelihood_normalized"])
def test_completion_model_select_matches_the_native_endpoint(openai_completion,
                                                             endpoint_backend, method):
    @sgl.function
    def pick(s):
        s += "Question: is fire cold?\nAnswer:"
        s += sgl.select("a", choices=[" yes", " no", " not at all"],
                        choices_method=getattr(sgl, method))

    via_openai = pick.run(backend=openai_completion)
    native = pick.run(backend=endpoint_backend)
    assert via_openai["a"] == native["a"]
    assert via_openai.get_meta_info("a")["normalized_prompt_logprobs"] == pytest.approx(
        native.get_meta_info("a")["normalized_prompt_logprobs"], abs=1e-3)


def test_chat_model_limits_are_reported(openai_chat):
    @sgl.function
    def select_on_chat(s):
        s += sgl.user("Pick")
        s += sgl.assistant(sgl.select("a", choices=["x", "y"]))

    @sgl.function
    def gen_outside_assistant(s):
        s += sgl.user("Hi") + sgl.gen("x", max_tokens=2)

    assert isinstance(select_on_chat.run(backend=openai_chat).error(), BackendError)
    error = gen_outside_assistant.run(backend=openai_chat).error()
    assert isinstance(error, ValueError) and "assistant" in str(error)

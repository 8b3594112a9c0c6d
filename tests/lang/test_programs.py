"""Programs end to end on each backend (in-process engine, HTTP server): gen and its options,
chat roles, variables and meta info, typed / constrained gens, streaming."""

from __future__ import annotations

import asyncio
import json

import pytest

import arborlm.lang as sgl
from tests.lang.conftest import GREEDY, require_grammar

PROMPT = "The quick brown fox"


def raw(backend, text, **sampling):
    """The runtime's own answer for `text`, bypassing the DSL."""
    params = {"temperature": 0, "stop": list(backend.get_chat_template().stop_str), **sampling}
    return backend.request({"text": text, "sampling_params": params})


@sgl.function
def continue_text(s, prompt, n):
    s += prompt
    s += sgl.gen("x", max_tokens=n)


def test_gen_continues_the_program_text(backend):
    state = continue_text.run(PROMPT, 8, backend=backend, **GREEDY)
    expected = raw(backend, PROMPT, max_new_tokens=8)
    assert state["x"] == expected["text"]
    assert state.text() == PROMPT + expected["text"]
    meta = state.get_meta_info("x")
    assert meta["completion_tokens"] == expected["meta_info"]["completion_tokens"]
    assert meta["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]


def test_gen_options_reach_the_runtime(backend):
    full = raw(backend, PROMPT, max_new_tokens=12, ignore_eos=True)["text"]
    stop = full[4:6]

    @sgl.function
    def prog(s):
        s += PROMPT
        with s.var_scope("scoped"):
            s += sgl.gen("stopped", max_tokens=12, stop=stop, ignore_eos=True)
        s += sgl.gen("fixed", max_tokens=5, min_tokens=5, ignore_eos=True,
                     return_logprob=True, top_logprobs_num=2)

    state = prog.run(backend=backend, **GREEDY)
    assert state["stopped"] == full[:full.find(stop)]
    assert state["scoped"] == state["stopped"]
    meta = state.get_meta_info("fixed")
    assert meta["completion_tokens"] == 5
    assert len(meta["output_token_logprobs"]) == 5
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])


def test_program_defaults_apply_to_every_gen(backend):
    state = continue_text.run(PROMPT, None, backend=backend, max_new_tokens=3, ignore_eos=True,
                              **GREEDY)
    assert state.get_meta_info("x")["completion_tokens"] == 3


def test_default_backend_is_used_without_backend_argument(backend, monkeypatch):
    monkeypatch.setattr("arborlm.lang.program._default_backend", None)
    sgl.set_default_backend(backend)
    assert sgl.get_default_backend() is backend
    state = continue_text.run(PROMPT, 4, **GREEDY)
    assert state["x"] == raw(backend, PROMPT, max_new_tokens=4)["text"]


@sgl.function
def chat(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6))
    with s.user():
        s += "And then?"
    with s.assistant():
        s += sgl.gen("more", max_tokens=4)


def test_roles_follow_the_models_chat_template(backend, tiny_path):
    from transformers import AutoTokenizer

    state = chat.run("What is 2+2?", backend=backend, **GREEDY)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user",
                                             "assistant"]
    assert messages[1]["content"] == "What is 2+2?"
    assert messages[2]["content"] == state["answer"].lstrip()
    assert messages[3]["content"] == "And then?"
    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    # The program's text is the model's own template without BOS (the runtime adds it).
    assert tok.bos_token + state.text() == tok.apply_chat_template(messages, tokenize=False)


def test_streaming_yields_the_same_text(backend):
    final = chat.run("Stream this", backend=backend, **GREEDY)
    state = chat.run("Stream this", backend=backend, stream=True, **GREEDY)
    pieces = list(state.text_iter())
    # At least one piece per expression (the constant prefix, then each gen); how many more
    # depends on how fast this thread reads (a slow reader gets tokens coalesced), so the count
    # is a floor, not a figure.
    assert len(pieces) >= 3
    assert "".join(pieces) == final.text()
    var_state = chat.run("Stream this", backend=backend, stream=True, **GREEDY)
    assert "".join(var_state.text_iter("answer")) == final["answer"]

    async def collect():
        s = chat.run("Stream this", backend=backend, stream=True, **GREEDY)
        text = [piece async for piece in s.text_async_iter()]
        with_meta = [item async for item in s.text_async_iter("more", return_meta_data=True)]
        return text, with_meta

    text, with_meta = asyncio.run(collect())
    assert "".join(text) == final.text()
    assert "".join(piece for piece, _ in with_meta) == final["more"]
    assert all("completion_tokens" in meta for _, meta in with_meta)
    assert var_state.get_meta_info("answer")["completion_tokens"] == \
        final.get_meta_info("answer")["completion_tokens"]


def test_non_streaming_text_iter_yields_once(backend):
    state = continue_text.run(PROMPT, 3, backend=backend, **GREEDY)
    assert list(state.text_iter()) == [state.text()]
    assert list(state.text_iter("x")) == [state["x"]]


def test_typed_and_constrained_gens(backend):
    require_grammar(backend)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}

    @sgl.function
    def prog(s):
        s += "Number: " + sgl.gen_int("n", max_tokens=6) + "\n"
        s += "Flag: " + sgl.gen("b", dtype=bool, max_tokens=4) + "\n"
        s += "Word: " + sgl.gen("w", regex="[a-z]{3}", max_tokens=6) + "\n"
        s += "Pick: " + sgl.gen("c", choices=["red", "green"], max_tokens=6) + "\n"
        s += "JSON: " + sgl.gen("j", json_schema=schema, max_tokens=64)

    state = prog.run(backend=backend, **GREEDY)
    assert state.error() is None
    assert isinstance(state["n"], int) and isinstance(state["b"], bool)
    assert len(state["w"]) == 3 and state["w"].isalpha()
    assert state["c"] in ("red", "green")
    data = json.loads(state["j"])
    assert set(data) == {"name", "age"} and isinstance(data["age"], int)


def test_an_engine_is_accepted_as_the_backend(engine_backend, monkeypatch):
    from arborlm.lang.backends.engine_backend import EngineBackend

    monkeypatch.setattr("arborlm.lang.program._default_backend", None)
    sgl.set_default_backend(engine_backend.engine)
    wrapped = sgl.get_default_backend()
    assert isinstance(wrapped, EngineBackend) and wrapped.engine is engine_backend.engine
    assert continue_text.run(PROMPT, 4, **GREEDY)["x"] == \
        raw(engine_backend, PROMPT, max_new_tokens=4)["text"]
    with pytest.raises(TypeError, match="not a backend"):
        sgl.set_default_backend("http://not-a-backend")

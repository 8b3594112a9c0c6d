"""Bad input raises a clear error naming the problem, and leaves the engine usable."""

from __future__ import annotations

import json

import pytest

from arborlm import Engine
from arborlm.errors import InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def engine(make_tiny_model):
    return Engine(str(make_tiny_model("llama")), dtype="float32", context_length=64)


@pytest.mark.parametrize("kwargs, match", [
    ({"prompt": ""}, "prompt is empty"),
    ({"input_ids": []}, "prompt is empty"),
    ({"prompt": "word " * 200}, "longer than the model's context length"),
    ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}},
     r"max_new_tokens must be in \[0, "),
    ({"prompt": "hi", "sampling_params": {"top_p": 0.0}}, r"top_p must be in \(0, 1\]"),
    ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, r"top_p must be in \(0, 1\]"),
    ({"prompt": "hi", "sampling_params": {"temperature": -1}},
     r"temperature must be in \[0, 100\]"),
    ({"prompt": "hi", "sampling_params": {"top_k": 0}}, "top_k must be -1"),
    ({"prompt": "hi", "sampling_params": {"n": 0}}, "n must be in"),
    ({"prompt": "hi", "sampling_params": {"max_new_tokens": "5"}},
     "max_new_tokens must be an integer"),
    ({"prompt": "hi", "sampling_params": {"bogus": 1}}, "unknown sampling parameter"),
    ({"prompt": "hi", "sampling_params": {"stop": ""}}, "stop must be non-empty"),
    ({"input_ids": [1, 10**9]}, "input_ids must be in"),
    ({"prompt": "hi", "input_ids": [1]}, "exactly one of text / input_ids"),
    ({"prompt": ["a", "b"], "rid": ["x", "x"]}, "duplicate rid"),
    ({"prompt": "hi", "top_logprobs_num": -2}, "top_logprobs_num"),
    ({"prompt": "hi", "return_logprob": True, "logprob_start_len": 50},
     "logprob_start_len"),
    ({"prompt": "hi", "sampling_params": {"regex": "a", "ebnf": "b"}}, "at most one of"),
])
def test_bad_requests_raise_clear_errors(engine, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate(**kwargs)
    # the engine keeps serving
    out = engine.generate("hi", {"max_new_tokens": 2, "temperature": 0})
    assert len(out["output_ids"]) <= 2
    assert engine.scheduler.is_idle


def test_error_names_the_field(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("hi", {"top_p": 2})
    assert info.value.param == "top_p"


def test_unknown_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        Engine(str(tmp_path / "nope"))


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        Engine(str(tmp_path))


def test_unknown_engine_option(make_tiny_model):
    with pytest.raises(InvalidRequestError, match="unknown engine option"):
        Engine(str(make_tiny_model("llama")), max_total_tokenz=10)


def test_bad_engine_option_values(make_tiny_model):
    path = str(make_tiny_model("llama"))
    with pytest.raises(InvalidRequestError, match="schedule_policy"):
        Engine(path, schedule_policy="random")
    with pytest.raises(InvalidRequestError, match="dtype"):
        Engine(path, dtype="float64")


def test_generation_stops_at_the_context_length(engine):
    out = engine.generate("word " * 20, {"max_new_tokens": 500, "temperature": 0,
                                          "ignore_eos": True})
    meta = out["meta_info"]
    assert meta["prompt_tokens"] + meta["completion_tokens"] == 64
    assert meta["finish_reason"]["type"] == "length"

"""`SamplingParams` / `GenerateRequest` validation, the one place every edge (Engine API, native
and OpenAI routes) checks values: each bad value is an `InvalidRequestError` naming the field
and its limit; values at the limits pass."""

from __future__ import annotations

import math

import pytest

from arborlm.errors import InvalidRequestError
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.runtime.request_limits import (
    MAX_ABS_LOGIT_BIAS,
    MAX_STOP_REGEX_CHARS,
    MAX_STOP_REGEXES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    MAX_TOKEN_IDS_LOGPROB,
    SEED_MAX,
    SEED_MIN,
    tree_error,
)
from arborlm.runtime.sampling_params import SamplingParams

NAN, INF = math.nan, math.inf
SURROGATE = "ab\ud800cd"


@pytest.mark.parametrize("params, field, hint", [
    ({"temperature": NAN}, "temperature", "[0, 100]"),  # bug: NaN sampled token 0 forever
    ({"temperature": INF}, "temperature", "[0, 100]"),
    ({"temperature": 101}, "temperature", "[0, 100]"),
    ({"top_p": NAN}, "top_p", "(0, 1]"),
    ({"min_p": -INF}, "min_p", "[0, 1]"),
    ({"frequency_penalty": NAN}, "frequency_penalty", "[-2, 2]"),
    ({"presence_penalty": INF}, "presence_penalty", "[-2, 2]"),
    ({"repetition_penalty": NAN}, "repetition_penalty", "(0, 2]"),
    ({"top_k": 2**70}, "top_k", "-1 (all)"),
    ({"top_k": True}, "top_k", "integer"),
    ({"max_new_tokens": 2**40}, "max_new_tokens", "2147483647"),
    ({"min_new_tokens": -1}, "min_new_tokens", "[0, "),
    ({"n": 2**70}, "n", "[1, 64]"),
    ({"sampling_seed": 2**70}, "sampling_seed", "signed 64-bit"),  # bug: a 500 (msgspec)
    ({"sampling_seed": SEED_MIN - 1}, "sampling_seed", "signed 64-bit"),
    ({"sampling_seed": 1.5}, "sampling_seed", "integer"),
    ({"logit_bias": {"5": NAN}}, "logit_bias", f"{MAX_ABS_LOGIT_BIAS:g}"),
    ({"logit_bias": {"5": 10**400}}, "logit_bias", "numbers"),
    ({"logit_bias": {"5": 2 * MAX_ABS_LOGIT_BIAS}}, "logit_bias", f"{MAX_ABS_LOGIT_BIAS:g}"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias", "token ids"),
    ({"stop": "x" * 1_000_000}, "stop", f"at most {MAX_STOP_STRING_CHARS} characters"),
    ({"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop", f"at most {MAX_STOP_STRINGS}"),
    ({"stop": [SURROGATE]}, "stop", "lone surrogate U+D800"),
    ({"stop": ["x" * 1000] * 9}, "stop", f"total at most {MAX_STOP_TOTAL_CHARS}"),
    ({"stop_regex": "(["}, "stop_regex", "missing ]"),  # bug: killed the scheduler process
    ({"stop_regex": r"(\w+)\1"}, "stop_regex", "no backreferences"),
    ({"stop_regex": ["a"] * (MAX_STOP_REGEXES + 1)}, "stop_regex", f"at most {MAX_STOP_REGEXES}"),
    ({"stop_regex": "a" * (MAX_STOP_REGEX_CHARS + 1)}, "stop_regex", "characters"),
    ({"stop_regex": SURROGATE}, "stop_regex", "lone surrogate"),
    ({"stop_token_ids": [0] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids",
     str(MAX_STOP_TOKEN_IDS)),
    ({"stop_token_ids": [2**70]}, "stop_token_ids", "token ids"),
    ({"regex": SURROGATE}, "regex", "lone surrogate"),
    ({"json_schema": "{\"\udfff\": 1}"}, "json_schema", "lone surrogate U+DFFF"),
    ({"ebnf": 5}, "ebnf", "string"),
    ({"choices": ["ok", SURROGATE]}, "choices", "lone surrogate"),
    ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
])
def test_bad_sampling_values_name_the_field_and_limit(params, field, hint):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(params)
    assert info.value.param == field
    assert hint in info.value.message, info.value.message


def test_values_at_the_limits_pass():
    stops = ["s" * (MAX_STOP_TOTAL_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS
    SamplingParams.from_dict({"stop": stops, "sampling_seed": SEED_MAX, "temperature": 100,
                              "logit_bias": {"3": -MAX_ABS_LOGIT_BIAS}})
    SamplingParams.from_dict({"stop": ["x" * MAX_STOP_STRING_CHARS],
                              "stop_regex": [r"\d+"] * MAX_STOP_REGEXES,
                              "sampling_seed": SEED_MIN, "top_k": 2**31 - 1})


@pytest.mark.parametrize("kwargs, field, hint", [
    ({"text": SURROGATE}, "text", "lone surrogate U+D800 at character 2"),  # bug: a 500
    ({"text": ["ok", SURROGATE]}, "text", "lone surrogate"),
    ({"text": "x", "rid": SURROGATE}, "rid", "lone surrogate"),
    ({"text": "x", "rid": "r" * 513}, "rid", "512"),
    ({"text": "x", "extra_key": SURROGATE}, "extra_key", "lone surrogate"),
    ({"text": "x", "priority": 2**70}, "priority", "2147483647"),
    ({"input_ids": [1, 2**70]}, "input_ids", "token ids"),
    ({"text": "x", "logprob_start_len": 2**70}, "logprob_start_len", ">= -1"),
    ({"text": "x", "token_ids_logprob": list(range(MAX_TOKEN_IDS_LOGPROB + 1))},
     "token_ids_logprob", str(MAX_TOKEN_IDS_LOGPROB)),
    ({"text": "x", "token_ids_logprob": [2**70]}, "token_ids_logprob", "token ids"),
])
def test_bad_request_fields_name_the_field(kwargs, field, hint):
    with pytest.raises(InvalidRequestError) as info:
        GenerateRequest(**kwargs).normalize()
    assert info.value.param == field
    assert hint in info.value.message, info.value.message


def test_parallel_sample_seeds_wrap_within_64_bits():
    singles = GenerateRequest(text="x", sampling_params={"n": 3, "sampling_seed": SEED_MAX - 1}
                              ).normalize()
    assert [s.sampling_params.sampling_seed for s in singles] == [SEED_MAX - 1, SEED_MAX,
                                                                   SEED_MIN]


def test_tree_error_finds_the_first_bad_leaf():
    assert tree_error({"a": [1, {"b": "ok"}]}) is None
    assert tree_error({"a": [1, {"b": SURROGATE}]})[0] == "a[1].b"
    assert tree_error({"a": {"c": NAN}}) == ("a.c", "must be a finite number, got nan")
    deep: list = []
    node = deep
    for _ in range(100_000):  # deeper than the recursion limit
        node.append([])
        node = node[0]
    node.append(INF)
    assert tree_error(deep) is not None

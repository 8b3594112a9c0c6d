"""Every process-boundary message survives encode/decode; bad bytes fail clearly."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest

from arborlm.errors import MessageDecodeError
from arborlm.runtime import messages as m
from arborlm.runtime.sampling_params import SamplingParams

LOGPROBS = m.LogprobChunk(
    output_token_logprobs=[(-0.25, 7, None), (-math.inf, 8, None)],
    output_top_logprobs=[[(-0.25, 7, None), (-1.5, 9, None)], [(-0.1, 8, None)]],
    output_token_ids_logprobs=[[(-3.0, 100, None)], [(-2.0, 100, None)]],
    input_token_logprobs=[(None, 1, None), (-2.5, 415, None)],
    input_top_logprobs=[None, [(-0.5, 415, None)]],
    input_token_ids_logprobs=[None, [(-4.0, 100, None)]],
)

TEXT_LOGPROBS = m.LogprobChunk(
    output_token_logprobs=[(-0.1, 101, " cat")], input_token_logprobs=[(None, 1, "<s>")]
)

EXAMPLES = [
    m.TokenizedGenerateReq(
        rid="r1",
        input_ids=[1, 2, 3],
        sampling_params=dataclasses.asdict(SamplingParams(stop=["\n"], logit_bias={5: -1.0})),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        token_ids_logprob=[100],
        return_text_in_logprobs=True,
        stream=True,
        extra_key="salt",
        priority=3,
        seed=42,
    ),
    m.TokenizedGenerateReq(rid="r2", input_ids=[], sampling_params={}),
    m.BatchTokenizedGenerateReq(reqs=[
        m.TokenizedGenerateReq(rid="b-0", input_ids=[1, 2], sampling_params={}, seed=1),
        m.TokenizedGenerateReq(rid="b-1", input_ids=[1, 2], sampling_params={}, seed=2),
    ]),
    m.AbortReq(rid="r1"),
    m.AbortReq(abort_all=True),
    m.FlushCacheReq(),
    m.FlushCacheResp(ok=False, message="2 requests pending"),
    m.GetServerInfoReq(),
    m.ServerInfoResp(info={"max_total_num_tokens": 4096, "hit_rate": 0.5, "nested": {"a": [1]}}),
    m.HealthCheckReq(),
    m.HealthCheckResp(ok=True),
    m.ShutdownReq(),
    m.BatchTokenOutput(
        rids=["a", "b"],
        new_token_ids=[[5, 6], [7]],
        finished_reasons=[None, {"type": "stop", "matched": "\n"}],
        prompt_tokens=[3, 4],
        completion_tokens=[2, 1],
        cached_tokens=[0, 2],
        decode_options=[
            m.DecodeOptions(stop=["\n"], skip_special_tokens=False, prompt_tail_ids=[2, 3]),
            None,
        ],
        logprobs=[LOGPROBS, None],
    ),
    m.BatchTextOutput(
        rids=["a"],
        texts=["hello 😀"],
        output_ids=[[101]],
        finished_reasons=[{"type": "length", "length": 1}],
        prompt_tokens=[2],
        completion_tokens=[1],
        cached_tokens=[0],
        logprobs=[TEXT_LOGPROBS],
        matched_stops=[None],
    ),
    m.ErrorOutput(rid="r9", message="prompt too long", status_code=400),
    m.ErrorOutput(rid="r10", message="top_k must be ...", status_code=400, param="top_k"),
    m.ProcessProgress(process="scheduler", phase="compiling kernels"),
    m.ProcessReady(process="scheduler", info={"max_total_tokens": 4096}),
    m.ProcessFailed(process="scheduler", error_type="ModelLoadError", message="no weights",
                    traceback="Traceback ..."),
]


def test_every_message_type_has_an_example():
    assert {type(e) for e in EXAMPLES} == set(m.MESSAGE_TYPES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(msg):
    data = m.encode(msg)
    assert isinstance(data, bytes)
    back = m.decode(data)
    assert type(back) is type(msg)
    assert back == msg


def test_sampling_params_survive_the_trip():
    params = SamplingParams(temperature=0.5, stop=["a", "b"], logit_bias={3: 2.0}, n=2)
    req = m.TokenizedGenerateReq(rid="x", input_ids=[1], sampling_params=dataclasses.asdict(params))
    back = m.decode(m.encode(req))
    assert back.sampling_params["logit_bias"] == {3: 2.0}
    rebuilt = SamplingParams.from_dict(back.sampling_params)
    assert rebuilt == params


def test_integer_logprob_decodes_as_float():
    chunk = m.LogprobChunk(output_token_logprobs=[(0, 1, None)])
    msg = m.BatchTokenOutput(
        rids=["a"],
        new_token_ids=[[1]],
        finished_reasons=[None],
        prompt_tokens=[1],
        completion_tokens=[1],
        cached_tokens=[0],
        decode_options=[None],
        logprobs=[chunk],
    )
    value = m.decode(m.encode(msg)).logprobs[0].output_token_logprobs[0][0]
    assert value == 0.0 and isinstance(value, float)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"not msgpack at all",
        msgspec.msgpack.encode({"rid": "a"}),
        msgspec.msgpack.encode(["NoSuchMessage", 1]),
        msgspec.msgpack.encode(["AbortReq", 5]),
        m.encode(m.ErrorOutput(rid="a", message="b"))[:-2],
    ],
)
def test_bad_bytes_raise_message_decode_error(data):
    with pytest.raises(MessageDecodeError, match="cannot decode a message"):
        m.decode(data)


@pytest.mark.parametrize("obj", [{"rid": "a"}, "text", m.DecodeOptions(), m.LogprobChunk(), None])
def test_encoding_a_non_message_is_a_type_error(obj):
    with pytest.raises(TypeError, match="not a process-boundary message"):
        m.encode(obj)

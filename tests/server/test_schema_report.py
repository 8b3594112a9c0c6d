"""`schema_report.py` and the `strict` fields, without a server: what a non-strict JSON schema's
sequences report (`json_schema_unenforced`, `json_schema_valid`), which sequences get a report,
and how OpenAI's `response_format.json_schema.strict` and the native `json_schema_strict` reach
the engine's sampling parameters. The routes' end-to-end behaviour is in
`test_structured_outputs.py`.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from arborlm.errors import InvalidRequestError
from arborlm.runtime import schema_report
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.runtime.sampling_params import SamplingParams
from arborlm.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from arborlm.server.protocol import GenerateReqInput

IRI = {"type": "object", "properties": {"link": {"type": "string", "format": "iri",
                                                  "maxLength": 8}}, "required": ["link"]}
PLAIN = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_output_valid_against_the_original_schema():
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}
    assert schema_report.output_valid('["a", "b"]', schema) is True
    assert schema_report.output_valid('["a", "a"]', schema) is False
    assert schema_report.output_valid('["a", ', schema) is False  # cut short: not JSON
    assert schema_report.output_valid('"x@y.z"', {"format": "email"}) is True
    assert schema_report.output_valid('"nope"', {"format": "email"}) is False
    assert schema_report.output_valid("1", {"$ref": "https://example.invalid/s.json"}) is None


def test_unenforced_names_each_keyword_by_pointer():
    found = schema_report.json_schema_unenforced(json.dumps(IRI), "xgrammar")
    assert any(item.startswith("#/properties/link/format") for item in found), found
    assert schema_report.json_schema_unenforced(json.dumps(PLAIN), "xgrammar") == ()


def test_only_non_strict_schemas_get_a_report_per_sequence():
    req = GenerateRequest(text=["a", "b", "c"], sampling_params=[
        {"json_schema": json.dumps(IRI), "json_schema_strict": False, "n": 2},
        {"json_schema": json.dumps(IRI)},  # strict: refused or valid by construction
        {"json_schema": json.dumps(PLAIN), "json_schema_strict": False}])
    reports = schema_report.reports(req, "xgrammar")
    assert sorted(reports) == [0, 1, 3]  # prompt 0's two samples, prompt 2's one
    assert reports[0] is reports[1] and reports[3].unenforced == ()


def _events(items):
    async def gen():
        for item in items:
            yield item
    return gen()


def test_attach_annotates_events_and_validates_the_final_one():
    req = GenerateRequest(text="a", sampling_params={
        "json_schema": json.dumps(PLAIN), "json_schema_strict": False})
    chunks = [(0, {"text": '{"n": ', "meta_info": {"finish_reason": None}}),
              (0, {"text": '{"n": 3}', "meta_info": {"finish_reason": {"type": "stop"}}})]

    async def run():
        return [e async for e in schema_report.attach(_events(chunks), req, "xgrammar")]

    out = asyncio.run(run())
    assert out[0][1]["meta_info"] == {"finish_reason": None, "json_schema_unenforced": []}
    assert out[1][1]["meta_info"]["json_schema_valid"] is True
    assert schema_report.choice_fields(out[0][1]["meta_info"]) == {}
    assert schema_report.choice_fields(out[1][1]["meta_info"]) == {
        "json_schema_unenforced": [], "json_schema_valid": True}
    strict = GenerateRequest(text="a", sampling_params={"json_schema": json.dumps(PLAIN)})
    events = _events(chunks)
    assert schema_report.attach(events, strict, "xgrammar") is events


def test_strict_reaches_the_sampling_parameters():
    def sampling(strict):
        spec = {"name": "x", "schema": PLAIN} | ({} if strict is None else {"strict": strict})
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                     response_format={"type": "json_schema",
                                                      "json_schema": spec})
        return body.response_format.sampling()

    assert sampling(None)["json_schema_strict"] is True
    assert sampling(True)["json_schema_strict"] is True
    assert sampling(False)["json_schema_strict"] is False
    assert CompletionRequest(prompt="hi", json_schema="{}",
                             json_schema_strict=False).json_schema_strict is False
    native = GenerateReqInput(text="hi", sampling_params={"json_schema": "{}",
                                                          "json_schema_strict": False})
    params = SamplingParams.from_dict(native.to_generate_request().sampling_params)
    assert params.json_schema_strict is False
    assert SamplingParams().json_schema_strict is True
    with pytest.raises(InvalidRequestError, match="json_schema_strict"):
        SamplingParams.from_dict({"json_schema": "{}", "json_schema_strict": "no"})

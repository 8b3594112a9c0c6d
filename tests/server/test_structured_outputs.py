"""Structured outputs through the OpenAI API: `response_format`, the `regex` / `ebnf` extensions
and tool calls (`tool_choice` required / named / auto / none), against a real server with the
`openai` client; plus unit tests of `tool_calls.py` (the tool-call grammar and parser).

The tiny model is random, so the outputs only show what the grammar enforces: every schema
here bounds its strings and numbers, so that a complete value fits in `max_tokens`.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from arborlm.constrained import create_grammar_backend
from arborlm.errors import InvalidRequestError
from arborlm.runtime.models.factory import build_tokenizer
from arborlm.server.openai_protocol import NamedToolChoice, Tool
from arborlm.server.tool_calls import ToolCallStream, parse_tool_calls, tool_policy
from tests.server.server_process import running_server

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": -100, "maximum": 100},
    "b": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": ADD}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
CALL_TEXT = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "celsius"}}</tool_call>')
GREEDY = {"temperature": 0, "max_tokens": 200}


@pytest.fixture(scope="module")
def server(make_tiny_model):
    with running_server(make_tiny_model("llama"), "--served-model-name", MODEL,
                        "--context-length", "2048") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          **{**GREEDY, **kwargs})


def assert_calls_valid(message, names=frozenset(SCHEMAS)):
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# --- response_format and the regex / ebnf extensions --------------------------------------------


def test_json_object_output_is_a_json_object(client):
    """Any object: the random model may write one too long for `max_tokens`, so sample a few;
    those that end on their own parse."""
    out = chat(client, response_format={"type": "json_object"}, n=4, seed=1, temperature=1.0)
    done = [c.message.content for c in out.choices if c.finish_reason == "stop"]
    assert done
    assert all(isinstance(json.loads(text), dict) for text in done)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}}, "required": ["user"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}}, "required": ["colour", "ok"]},
    {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                      "note": {"type": "string", "maxLength": 5},
                                      "flag": {"type": "boolean"}}, "required": ["id", "flag"]},
], ids=["nested", "enum", "array-bounds", "required"])
def test_json_schema_output_validates(client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                  "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=5,
                                         temperature=1.0, max_tokens=200, response_format=fmt)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_extension_output_fullmatches(client):
    pattern = r"(yes|no), [1-9][0-9]{0,2} (apples|pears)"
    done = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=0,
                                     extra_body={"regex": pattern}).choices[0]
    assert done.finish_reason == "stop" and re.fullmatch(pattern, done.text)
    said = chat(client, extra_body={"regex": pattern}).choices[0].message.content
    assert re.fullmatch(pattern, said)


def test_ebnf_extension_output_parses(client):
    grammar = ('root ::= "(" expr ")"\n'
               'expr ::= num (op num){0,3}\n'
               'op ::= " + " | " * "\n'
               'num ::= [1-9] [0-9]?')
    out = chat(client, extra_body={"ebnf": grammar}).choices[0]
    assert out.finish_reason == "stop"
    text = out.message.content
    assert re.fullmatch(r"\([1-9][0-9]?(?: [+*] [1-9][0-9]?){0,3}\)", text)
    assert isinstance(eval(text, {"__builtins__": {}}), int)  # noqa: S307 - checked above


# --- tools ---------------------------------------------------------------------------------------


def test_tool_choice_required_calls_validate_against_their_tool(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=8, seed=3,
        temperature=1.0, max_tokens=200, parallel_tool_calls=False)
    names = set()
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        assert_calls_valid(choice.message)
        names.add(choice.message.tool_calls[0].function.name)
    assert names == set(SCHEMAS)  # both tools were chosen by some sample


def test_tool_choice_required_parallel_calls(client):
    out = chat(client, tools=TOOLS, tool_choice="required").choices[0]
    assert out.finish_reason in ("tool_calls", "length")
    assert_calls_valid(out.message)
    assert len({c.id for c in out.message.tool_calls}) == len(out.message.tool_calls)


def test_named_function_calls_that_function(client):
    choice = {"type": "function", "function": {"name": "add"}}
    out = chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=2).choices[0]
    assert out.finish_reason == "tool_calls"
    assert [c.function.name for c in out.message.tool_calls] == ["add"]
    assert_calls_valid(out.message)


def test_streamed_tool_calls_match_the_response(client):
    kwargs = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    whole = chat(client, **kwargs).choices[0].message.tool_calls[0].function
    chunks = list(chat(client, stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == \
        [(0, whole.name, whole.arguments)]
    assert "".join(d.content or "" for d in deltas) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_parses_a_call_the_model_writes(client):
    """The `ebnf` field makes the model write a call in the template's format."""
    grammar = "root ::= " + json.dumps("Sure. " + CALL_TEXT)
    out = chat(client, tools=TOOLS, tool_choice="auto", extra_body={"ebnf": grammar}).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Sure."
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    chunks = list(chat(client, tools=TOOLS, extra_body={"ebnf": grammar}, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure. "
    [streamed] = [call for d in deltas for call in d.tool_calls or []]
    assert streamed.function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_offers_no_tools_and_parses_nothing(client):
    grammar = "root ::= " + json.dumps(CALL_TEXT)
    out = chat(client, tools=TOOLS, tool_choice="none", extra_body={"ebnf": grammar})
    assert out.choices[0].message.content == CALL_TEXT and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"
    plain = chat(client, max_tokens=1)
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens  # no tools in the prompt
    offered = chat(client, max_tokens=1, tools=TOOLS)
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens


def test_tool_calls_in_history_render_and_round_trip(client):
    first = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    message = first.choices[0].message
    history = [*MESSAGES, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens > first.usage.prompt_tokens


# --- errors --------------------------------------------------------------------------------------

BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
# Enforced by neither the grammar nor the semantic guard (which now covers uniqueItems, not, ...).
UNSUPPORTED = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "array", "items": {"type": "string", "format": "iri"}}}}
BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "bogus"}}}}}]
UNSUPPORTED_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "not": {"const": "a"}}}}}}]


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": BAD_SCHEMA}, "response_format", "bogus"),
    ({"response_format": UNSUPPORTED}, "response_format", "#/items/format"),
    ({"extra_body": {"regex": "a(b"}}, "regex", "regex"),
    ({"extra_body": {"ebnf": "root ::= undefined_rule"}}, "ebnf", "undefined_rule"),
    ({"tools": BAD_TOOL, "tool_choice": "required"}, "tools", "bogus"),
    ({"tools": UNSUPPORTED_TOOL, "tool_choice": "required"}, "tools",
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "unique"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "at most one"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a"}}, "regex",
     "at most one"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_invalid_grammars_are_400s_and_the_server_keeps_serving(client, kwargs, param, words,
                                                                stream):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=5, stream=stream, **kwargs)
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"], error
    assert chat(client, max_tokens=3).choices[0].finish_reason == "length"


def test_completions_grammar_errors_name_their_field(server):
    for field, spec in (("json_schema", '{"type": "bogus"}'), ("regex", "(("),
                        ("ebnf", "root ::= ")):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 4, field: spec})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
    ok = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 30, "json_schema": json.dumps(ADD)})
    jsonschema.validate(json.loads(ok.json()["choices"][0]["text"]), ADD)


# --- strict and non-strict JSON schemas ----------------------------------------------------------

# Neither xgrammar nor jsonschema checks format "iri": strict refuses it, non-strict reports it.
IRI = {"type": "object", "properties": {"link": {"type": "string", "format": "iri",
                                                  "maxLength": 8}}, "required": ["link"]}


@pytest.mark.parametrize("strict", [None, True])
def test_strict_refusal_is_a_400_naming_the_pointer(client, strict):
    spec = {"name": "x", "schema": IRI} | ({} if strict is None else {"strict": strict})
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=5, response_format={"type": "json_schema", "json_schema": spec})
    error = info.value.body
    assert error["param"] == "response_format", error
    assert "#/properties/link/format" in error["message"], error


def _check_report(fields: dict, text: str) -> None:
    from arborlm.runtime.schema_report import output_valid

    assert [u.split(" ")[0] for u in fields["json_schema_unenforced"]] == [
        "#/properties/link/format"], fields
    assert fields["json_schema_valid"] is output_valid(text, IRI)


def test_non_strict_reports_what_is_unenforced_and_whether_it_validated(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": IRI, "strict": False}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "response_format": fmt, **GREEDY})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    _check_report(choice, choice["message"]["content"])
    if choice["finish_reason"] == "stop":
        assert choice["json_schema_valid"] is True
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": MESSAGES, "response_format": fmt, "stream": True,
            **GREEDY}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    last = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(last) == 1 and "json_schema_valid" in last[0]
    assert all("json_schema_valid" not in c["choices"][0] for c in chunks[:-1] if c["choices"]
               and not c["choices"][0]["finish_reason"])
    native = {"text": "hi", "sampling_params": {"json_schema": json.dumps(IRI),
                                                "json_schema_strict": False,
                                                "max_new_tokens": 200, "temperature": 0}}
    r = httpx.post(server.url + "/generate", timeout=60, json=native)
    assert r.status_code == 200, r.text
    _check_report(r.json()["meta_info"], r.json()["text"])
    r = httpx.post(server.url + "/generate", timeout=60, json={
        **native, "sampling_params": {**native["sampling_params"], "json_schema_strict": True}})
    assert r.status_code == 400 and "#/properties/link/format" in r.text, r.text
    plain = httpx.post(server.url + "/generate", timeout=60, json={
        "text": "hi", "sampling_params": {"json_schema": json.dumps(ADD), "max_new_tokens": 60}})
    assert "json_schema_valid" not in plain.json()["meta_info"]  # strict: nothing to report


# --- tool_calls.py -------------------------------------------------------------------------------


def tools(*names: str) -> list[Tool]:
    return [Tool.model_validate(t) for t in TOOLS if t["function"]["name"] in names]


def test_parser_reads_the_chat_templates_own_rendering():
    tokenizer = build_tokenizer(512)
    calls = [{"id": "call_1", "type": "function", "function": {
        "name": "add", "arguments": '{"a": 1, "b": 2}'}}, {"id": "call_2", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": "On it.", "tool_calls": calls}], tokenize=False)
    turn = rendered.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    content, parsed = parse_tool_calls(turn, frozenset(SCHEMAS))
    assert content == "On it."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]


@pytest.mark.parametrize("text, content, names", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', None, ["add"]),
    ('<tool_call>{"name": "sub", "arguments": {}}</tool_call>', "same", []),  # unknown tool
    ("<tool_call>{not json}</tool_call> ok", "same", []),
    ('x <tool_call>{"name": "add"}</tool_call> y', "x  y", ["add"]),  # arguments default {}
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "same", []),  # unclosed
    ("no calls", "same", []),
])
def test_parser_keeps_what_is_not_a_call(text, content, names):
    got_content, calls = parse_tool_calls(text, frozenset(SCHEMAS))
    assert got_content == (text if content == "same" else content)
    assert [c.name for c in calls] == names
    assert parse_tool_calls(text, frozenset()) == (text, [])  # no tools: nothing parsed


def test_parser_reserializes_raw_control_characters():
    _, [call] = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": '
                                 '{"city": "a\tb", "unit": "celsius"}}</tool_call>',
                                 frozenset(SCHEMAS))
    assert json.loads(call.arguments) == {"city": "a\tb", "unit": "celsius"}


def test_stream_splitter_holds_back_only_what_may_be_a_call():
    text = "Hi <tool! " + CALL_TEXT + " bye"
    split = ToolCallStream(frozenset(SCHEMAS))
    sent = "".join(split.content(text[:end]) for end in range(len(text) + 1))
    assert sent == "Hi <tool! "
    rest, calls = split.finish(text)
    assert rest == "bye" and [c.name for c in calls] == ["get_weather"]
    passthrough = ToolCallStream(frozenset())
    assert passthrough.content(CALL_TEXT) == CALL_TEXT
    assert passthrough.finish(CALL_TEXT) == ("", [])


def test_policy_per_tool_choice():
    offered = tools("get_weather", "add")
    auto = tool_policy(offered, None, None)
    assert auto.offered == offered and auto.forced is None and auto.names == set(SCHEMAS)
    assert auto.grammar(1) is None
    none = tool_policy(offered, "none", None)
    assert none.offered is None and not none.names
    named = tool_policy(offered, NamedToolChoice.model_validate({"function": {"name": "add"}}),
                        None)
    assert named.forced == tools("add") and not named.parallel and named.names == {"add"}
    required = tool_policy(offered, "required", False)
    assert required.forced == offered and not required.parallel
    assert tool_policy(None, None, None).names == frozenset()
    with pytest.raises(InvalidRequestError, match="needs tools"):
        tool_policy(None, "required", None)


@pytest.fixture(scope="module")
def xgrammar_backend():
    tokenizer = build_tokenizer(512)
    return tokenizer, create_grammar_backend("xgrammar", tokenizer, 512, [2, 5])


def accepts(backend, tokenizer, spec: str, text: str) -> bool:
    matcher = backend.compile("structural_tag", spec).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(2)


@pytest.mark.parametrize("parallel", [True, False])
def test_grammar_accepts_exactly_calls_of_the_forced_tools(xgrammar_backend, parallel):
    tokenizer, backend = xgrammar_backend
    spec = tool_policy(tools("get_weather", "add"), "required", parallel).grammar(1)
    add = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": -2}}</tool_call>'
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"x","unit":"celsius"}}\n' \
              '</tool_call>'
    assert accepts(backend, tokenizer, spec, add)
    assert accepts(backend, tokenizer, spec, weather)
    assert accepts(backend, tokenizer, spec, add + weather) == parallel
    for wrong in ("", "hello", add.replace('"a": 1', '"a": 101'),  # out of range
                  add.replace('"add"', '"get_weather"'),  # another tool's arguments
                  add.replace(', "b": -2', ""),  # a required argument missing
                  add.replace('"a": 1', '"a":  1')):  # two spaces: whitespace is bounded
        assert not accepts(backend, tokenizer, spec, wrong), wrong
    named = tool_policy(tools("get_weather", "add"),
                        NamedToolChoice.model_validate({"function": {"name": "add"}}), None)
    assert accepts(backend, tokenizer, named.grammar(1), add)
    assert not accepts(backend, tokenizer, named.grammar(1), weather)

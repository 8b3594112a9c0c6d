"""Speculative decoding (NGRAM) on the real default model: prompts the model copies from, so
drafts are long and mostly accepted. Greedy outputs equal plain decoding's token for token,
alone and batched, with a JSON schema, a stop string, logprobs (within `LOGPROB_TOL`) and chunked
prefill; speculation must actually have accepted drafts."""

from __future__ import annotations

import json

import pytest
import torch

from arborlm import Engine
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

PERSON = {"name": "Ada Lovelace", "born": 1815, "city": "London", "field": "mathematics",
          "email": "ada@example.org"}
TEXTS = [
    "Here is a JSON object:\n" + json.dumps(PERSON, indent=2) + "\nRewrite it exactly, changing "
    "only the city to Paris. Reply with the JSON only.",
    "Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog.",
    "Write a short poem about the sea.",
]
GREEDY = {"temperature": 0, "max_new_tokens": 64}
# ArborLM's AVX-512 kernels sum each output in one order for any number of rows, so a verify
# step's logprobs are plain decoding's to 1e-5. Without them (an AVX2-only CPU) float32 linears
# run on oneDNN, whose sums depend on the batch's shape: plain decoding itself moves by ~1e-5
# between a batch and a prompt alone there (measured 8.6e-6; spec against plain 1.2e-5).
LOGPROB_TOL = 1e-5 if cpu_kernels.available(torch.float32) else 5e-5


def _prompts(tokenizer) -> list[list[int]]:
    out = []
    for text in TEXTS:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


# Beside the session's default engine (a ~6 GB KV pool for SmolLM2), pools of the size these
# prompts need: default pools here (the draft model's doubling one) ran a 24 GB machine out of
# memory in CI.
POOL_TOKENS = 16_384


@pytest.fixture(scope="module")
def spec_engine(smollm2_gguf):
    with Engine(str(smollm2_gguf), speculative_algorithm="NGRAM", chunked_prefill_size=32,
                debug_integrity=True, max_total_tokens=POOL_TOKENS) as e:
        yield e


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_batched_and_alone_equal_plain(smollm2_engine, spec_engine):
    prompts = _prompts(smollm2_engine.tokenizer)
    params = [GREEDY] * len(prompts)
    plain = smollm2_engine.generate(input_ids=prompts, sampling_params=params)
    spec = spec_engine.generate(input_ids=prompts, sampling_params=params)
    assert _ids(spec) == _ids(plain)
    alone = spec_engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert alone["output_ids"] == plain[0]["output_ids"]
    assert alone["meta_info"]["spec_accept_length"] > 2.0
    info = spec_engine.get_server_info()
    assert info["spec_accepted_tokens"] > 20


def test_schema_stop_and_logprobs_equal_plain(smollm2_engine, spec_engine):
    prompts = _prompts(smollm2_engine.tokenizer)[:2]
    schema = json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "born", "city"]})
    for extra, kw in (({"json_schema": schema}, {}), ({"stop": ["lazy"]}, {}),
                      ({}, {"return_logprob": True, "top_logprobs_num": 2})):
        params = [dict(GREEDY, **extra)] * 2
        plain = smollm2_engine.generate(input_ids=prompts, sampling_params=params, **kw)
        spec = spec_engine.generate(input_ids=prompts, sampling_params=params, **kw)
        assert _ids(spec) == _ids(plain), extra or kw
        assert [o["text"] for o in spec] == [o["text"] for o in plain]
        if kw:
            for a, b in zip(plain, spec):
                la = a["meta_info"]["output_token_logprobs"]
                lb = b["meta_info"]["output_token_logprobs"]
                assert all(abs(x[0] - y[0]) <= LOGPROB_TOL and x[1] == y[1]
                           for x, y in zip(la, lb))


def test_standalone_self_draft_equals_plain(smollm2_gguf, smollm2_engine):
    """STANDALONE with the model drafting for itself (its own runner and KV pool): outputs equal
    plain decoding's, alone, batched and with a JSON schema, and nearly every draft token is
    accepted."""
    prompts = _prompts(smollm2_engine.tokenizer)
    params = [dict(GREEDY, max_new_tokens=40)] * len(prompts)
    schema = json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "city": {"type": "string"}}, "required": ["name", "city"]})
    constrained = dict(GREEDY, max_new_tokens=40, json_schema=schema)
    plain = smollm2_engine.generate(input_ids=prompts, sampling_params=params)
    plain_schema = smollm2_engine.generate(input_ids=prompts[0], sampling_params=constrained)
    with Engine(str(smollm2_gguf), speculative_algorithm="STANDALONE",
                speculative_draft_model_path=str(smollm2_gguf), speculative_num_steps=4,
                debug_integrity=True, max_total_tokens=POOL_TOKENS) as e:
        spec = e.generate(input_ids=prompts, sampling_params=params)
        alone = e.generate(input_ids=prompts[1], sampling_params=params[1])
        spec_schema = e.generate(input_ids=prompts[0], sampling_params=constrained)
        info = e.get_server_info()
    assert _ids(spec) == _ids(plain)
    assert alone["output_ids"] == plain[1]["output_ids"]
    assert spec_schema["output_ids"] == plain_schema["output_ids"]
    assert alone["meta_info"]["spec_accept_length"] > 3.0
    assert info["spec_accepted_tokens"] >= 0.9 * info["spec_draft_tokens"] > 0


BIO = ("Grace Hopper was born in New York City in 1906. She was a computer scientist and a rear "
       "admiral of the United States Navy, known for the COBOL language and for the first "
       "compiler. Contact: grace@example.org.")
BIO_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"},
    "occupation": {"type": "string"}, "known_for": {"type": "string"},
    "email": {"type": "string"}},
    "required": ["name", "born", "city", "occupation", "known_for", "email"]}


def test_spelled_keys_ride_in_verify_steps(smollm2_engine, spec_engine):
    """Extraction into a six-key schema: the keys, their quotes and separators are strings the
    grammar forces but not tokens, so the drafts spell them (`spec_grammar_spelled_tokens`) and
    the model accepts them: over 3 tokens per verify (2.4 without the spelling, measured), and
    the output equals plain decoding's."""
    chat = smollm2_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Extract the fields of this text as JSON.\n" + BIO}],
        add_generation_prompt=True, tokenize=False)
    ids = smollm2_engine.tokenizer.encode(chat, add_special_tokens=False)
    params = dict(GREEDY, max_new_tokens=96, json_schema=json.dumps(BIO_SCHEMA))
    plain = smollm2_engine.generate(input_ids=ids, sampling_params=params)
    spelled = spec_engine.get_server_info()["spec_grammar_spelled_tokens"]
    spec = spec_engine.generate(input_ids=ids, sampling_params=params)
    assert spec["output_ids"] == plain["output_ids"]
    assert set(json.loads(spec["text"])) == set(BIO_SCHEMA["properties"])
    assert spec_engine.get_server_info()["spec_grammar_spelled_tokens"] - spelled >= 20
    assert spec["meta_info"]["spec_accept_length"] > 3.0

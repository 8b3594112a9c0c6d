"""Rollback to a value's start: a value the semantic guard rejects when it closes is taken back
(tokens, KV, grammar and guard state, logprobs) to its first choice, that choice is banned there,
and decoding goes on; tokens of a value still open under a guard check are never streamed.

The tiny random Llama duplicates numbers in a `uniqueItems` array on these prompts (the old
same-position ban then dead-ended and aborted); `not` and an overlapping `oneOf` are made to
reject what greedy decoding produces without them. Each output must finish valid, the rollbacks
must have happened (`grammar_guard_rollbacks`), and the KV must stay exact: the same outputs
with pages of 4 and without the prefix cache, and `check_integrity` after each test.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from arborlm import Engine
from tests.runtime.engine_helpers import PROMPTS

GREEDY = {"temperature": 0.0, "max_new_tokens": 60}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 60, "sampling_seed": 3}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
UNIQUE = {"type": "array", "items": DIGIT, "minItems": 4, "maxItems": 4, "uniqueItems": True}
# Eleven different digits do not exist: every attempt ends in a duplicate.
IMPOSSIBLE = {**UNIQUE, "minItems": 11, "maxItems": 11}
NAMED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "nums": UNIQUE}, "required": ["name", "nums"]}


@pytest.fixture(scope="module")
def path(make_tiny_model):
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def engine(path):
    engine = Engine(path, dtype="float32", debug_integrity=True)
    yield engine
    engine.shutdown()


def rollbacks(engine) -> int:
    return engine.get_server_info()["grammar_guard_rollbacks"]


def run(engine, prompts, params) -> list[dict]:
    outs = engine.generate(prompts, params)
    return outs if isinstance(outs, list) else [outs]


def assert_valid(outs, schema) -> None:
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        jsonschema.validate(json.loads(out["text"]), schema)


def greedy_digit(engine, prompt) -> int:
    """What greedy decoding writes for `{"a": digit}` with nothing to reject."""
    schema = {"type": "object", "properties": {"a": DIGIT}, "required": ["a"]}
    return json.loads(run(engine, prompt, {**GREEDY, "json_schema": json.dumps(schema)})[0][
        "text"])["a"]


def excluding(engine, prompt, how: str) -> tuple[dict, int]:
    """A schema whose `a` must differ from what greedy decoding writes, by `not` or by an
    overlapping `oneOf` (that digit matches both branches), and that digit."""
    v = greedy_digit(engine, prompt)
    a = {**DIGIT, "not": {"const": v}} if how == "not" else \
        {"oneOf": [DIGIT, {"type": "integer", "minimum": v, "maximum": v}]}
    return {"type": "object", "properties": {"a": a}, "required": ["a"]}, v


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_duplicate_numbers_roll_back_and_finish_valid(engine, params):
    before = rollbacks(engine)
    outs = run(engine, PROMPTS[:4], {**params, "json_schema": json.dumps(UNIQUE)})
    outs += run(engine, PROMPTS[4], {**params, "json_schema": json.dumps(UNIQUE), "n": 4})
    assert_valid(outs, UNIQUE)
    assert rollbacks(engine) > before, "no duplicate was rolled back: the test shows nothing"
    engine.check_integrity()


@pytest.mark.parametrize("how", ["not", "oneOf"])
def test_not_and_overlapping_one_of_roll_back_to_another_value(engine, how):
    for prompt in PROMPTS[:3]:
        schema, v = excluding(engine, prompt, how)
        before = rollbacks(engine)
        (out,) = run(engine, prompt, {**GREEDY, "json_schema": json.dumps(schema)})
        assert_valid([out], schema)
        assert json.loads(out["text"])["a"] != v
        assert rollbacks(engine) > before
    engine.check_integrity()


def test_root_value_rolls_back_into_the_cached_prompt(engine, monkeypatch):
    """A root value rejected at the stop token goes back to output position 0: the kept
    prefix ends inside the prompt the request locked in the cache (locked shorter there)."""
    from arborlm.runtime.scheduler.kv_slots import KVSlots

    shortened = []
    real_rewind = KVSlots.rewind

    def rewind(self, req, n):
        cached = req.cached_len
        real_rewind(self, req, n)
        shortened.append(req.cached_len < cached)

    monkeypatch.setattr(KVSlots, "rewind", rewind)
    plain = run(engine, PROMPTS[1], {**GREEDY, "json_schema": json.dumps(DIGIT)})[0]
    schema = {**DIGIT, "not": {"const": int(plain["text"])}}
    out = engine.generate(PROMPTS[1], {**GREEDY, "json_schema": json.dumps(schema)},
                          return_logprob=True)
    assert_valid([out], schema)
    assert int(out["text"]) != int(plain["text"])
    assert any(shortened), shortened
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]  # the rolled-back entries are gone
    engine.check_integrity()


def test_rewound_kv_is_exact_across_page_sizes_and_without_the_cache(engine, path):
    """Outputs with rollbacks (inside an array, at the root into the cached prompt) are the
    same with pages of 4 (partial pages kept, locked prefixes page-aligned) and with the no-op
    prefix cache: the KV left after each rewind is what decoding would have computed."""
    root = {**DIGIT, "not": {"const": int(run(engine, PROMPTS[1], {
        **GREEDY, "json_schema": json.dumps(DIGIT)})[0]["text"])}}
    cases = [(PROMPTS[:4], UNIQUE, GREEDY), (PROMPTS[:4], UNIQUE, SAMPLED),
             (PROMPTS[1:2], root, GREEDY)]

    def outputs(eng) -> list[list[int]]:
        ids = []
        for prompts, schema, params in cases:
            outs = run(eng, prompts, {**params, "json_schema": json.dumps(schema)})
            assert_valid(outs, schema)
            ids += [o["output_ids"] for o in outs]
        return ids

    before = rollbacks(engine)
    want = outputs(engine)
    assert rollbacks(engine) > before
    for kwargs in ({"page_size": 4}, {"disable_radix_cache": True}):
        other = Engine(path, dtype="float32", debug_integrity=True, **kwargs)
        try:
            assert outputs(other) == want, kwargs
            assert rollbacks(other) > 0
            other.check_integrity()
        finally:
            other.shutdown()


def stream_all(engine, prompts, params) -> list[list[dict]]:
    async def one(prompt) -> list[dict]:
        it = await engine.async_generate(prompt, params, stream=True)
        return [chunk async for chunk in it]

    async def gather():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(gather())


def test_streaming_never_shows_text_that_is_rolled_back(engine):
    """The `nums` array is checked when it closes (its `uniqueItems`): no chunk shows part of
    it, while `name` streams as it comes; the streamed text is the final text."""
    before = rollbacks(engine)
    runs = stream_all(engine, PROMPTS[:4], {**GREEDY, "json_schema": json.dumps(NAMED)})
    assert rollbacks(engine) > before
    for chunks in runs:
        final = chunks[-1]
        assert_valid([final], NAMED)
        for chunk in chunks:
            text = chunk["text"]
            assert final["text"].startswith(text)
            if '"nums": ' in text:
                rest = text.split('"nums": ', 1)[1]
                assert rest == "" or rest.startswith("[") and "]" in rest, text
    engine.check_integrity()


def test_exhausted_retries_abort_alone_others_unchanged(engine):
    """The impossible array aborts with a message once its retries are spent; a guarded
    request, an unguarded schema and a plain request beside it finish as they do alone."""
    plain = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    schema = {"type": "object", "properties": {"x": DIGIT}, "required": ["x"]}
    others = [(PROMPTS[1], {**GREEDY, "json_schema": json.dumps(UNIQUE)}),
              (PROMPTS[2], {**GREEDY, "json_schema": json.dumps(schema)}),
              (PROMPTS[3], plain)]
    alone = [run(engine, p, params)[0] for p, params in others]
    outs = run(engine, [PROMPTS[0]] + [p for p, _ in others],
               [{**GREEDY, "max_new_tokens": 120, "json_schema": json.dumps(IMPOSSIBLE)}]
               + [params for _, params in others])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert reason["message"].startswith("json_schema guard: ") and "uniqueItems" in \
        reason["message"], reason
    for got, want in zip(outs[1:], alone):
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert engine.get_server_info()["grammar_active"] == 0
    engine.check_integrity()


def test_rollbacks_stop_at_their_token_budget(engine):
    """Every array of ten digits violates this `not`, so each attempt is rolled back whole (more
    than 20 tokens); the tokens one request's rollbacks drop stay within GUARD_ROLLBACK_BUDGET x
    max_new_tokens (64 bans would drop over a thousand), then it aborts with a message naming
    the budget, and a request beside it finishes as it does alone."""
    from arborlm.runtime.scheduler.grammar_manager import GUARD_ROLLBACK_BUDGET

    max_new = 30
    budget = GUARD_ROLLBACK_BUDGET * max_new
    never = {**UNIQUE, "minItems": 10, "maxItems": 10, "uniqueItems": False,
             "not": {"items": {"type": "integer"}}}
    other = {**GREEDY, "json_schema": json.dumps(UNIQUE)}
    alone = run(engine, PROMPTS[1], other)[0]
    before = engine.get_server_info()
    out, beside = run(engine, PROMPTS[:2], [
        {**GREEDY, "max_new_tokens": max_new, "json_schema": json.dumps(never)}, other])
    after = engine.get_server_info()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert "violates not" in reason["message"] and f"past the budget of {budget} " in \
        reason["message"], reason
    dropped = after["grammar_guard_dropped_tokens"] - before["grammar_guard_dropped_tokens"]
    dropped -= beside_dropped(engine, other)
    assert budget // 2 < dropped <= budget, dropped
    assert beside["output_ids"] == alone["output_ids"]
    assert after["grammar_active"] == 0
    engine.check_integrity()


def beside_dropped(engine, params) -> int:
    """Tokens the rollbacks of one request with `params` drop when it runs alone."""
    before = engine.get_server_info()["grammar_guard_dropped_tokens"]
    run(engine, PROMPTS[1], params)
    return engine.get_server_info()["grammar_guard_dropped_tokens"] - before


def test_multiprocess_runtime_rolls_back_the_same(engine, path):
    """Through the scheduler and detokenizer processes: the same outputs, streamed chunks
    included, as in process."""
    params = {**GREEDY, "json_schema": json.dumps(NAMED)}
    want = [o["text"] for o in run(engine, PROMPTS[:4], params)]
    multi = Engine(path, mode="multiprocess", dtype="float32", debug_integrity=True)
    try:
        assert [o["text"] for o in run(multi, PROMPTS[:4], params)] == want
        assert multi.get_server_info()["grammar_guard_rollbacks"] > 0
        runs = stream_all(multi, PROMPTS[:4], params)
        assert [chunks[-1]["text"] for chunks in runs] == want
        for chunks, text in zip(runs, want):
            assert all(text.startswith(c["text"]) for c in chunks)
    finally:
        multi.shutdown()

"""Grammar-constrained decoding through the engine: JSON schema, regex, EBNF and choices on both
backends, jump-forward exactness, logprobs, streaming, n > 1, chunked prefill, retraction, abort,
and per-request failures (invalid grammar, compile time limit) that leave everyone else served.

The model is the tiny random-weight Llama (512-token vocabulary), so outputs are gibberish that
only the grammar keeps in shape; schemas bound their strings and arrays so that every output
completes within `max_new_tokens`.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from arborlm import Engine
from arborlm.errors import GrammarError, InvalidRequestError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.request import Req
from arborlm.runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import PROMPTS, DirectScheduler

BACKENDS = ["xgrammar", "outlines"]
SCHEMAS = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 10},
                    "color": {"enum": ["red", "green", "blue"]},
                    "ok": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                             "maxItems": 3}},
     "required": ["name", "color", "ok", "tags"]},
    {"type": "object",
     "properties": {"id": {"type": "string", "pattern": "[0-9]{3}"},
                    "owner": {"type": "object",
                              "properties": {"first": {"type": "string", "maxLength": 6},
                                             "admin": {"type": "boolean"}},
                              "required": ["first", "admin"]}},
     "required": ["id", "owner"]},
    {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 4},
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{3,12}\.",
           r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}"]
ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "*") term)?
term ::= num | "(" num ("+" | "-") num ")"
num ::= [1-9] [0-9]?
"""
# 300 properties with patterns: ~0.4 s to compile with xgrammar, far past a 0.05 s limit.
SLOW_SCHEMA = json.dumps({
    "type": "object",
    "properties": {f"f{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 13 + 20}}}"
                                                         f"[0-9]{{2,{i % 5 + 3}}}"}
                   for i in range(300)},
    "required": [f"f{i}" for i in range(300)]})
GREEDY = {"temperature": 0.0, "max_new_tokens": 160}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 160, "sampling_seed": 11}


@pytest.fixture(scope="module")
def path(make_tiny_model):
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def engine(path):
    engine = Engine(path, dtype="float32", debug_integrity=True)
    yield engine
    engine.shutdown()


def jump_forward(engine: Engine, enabled: bool) -> None:
    grammars = engine.scheduler.grammars
    engine.client.call(lambda: setattr(grammars, "jump_forward_enabled", enabled))


def texts(outs: list[dict]) -> list[str]:
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    return [out["text"] for out in outs]


# --- every kind, both backends -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_outputs_validate(engine, backend):
    for schema in SCHEMAS:
        spec = {"json_schema": json.dumps(schema), "grammar_backend": backend}
        outs = engine.generate(PROMPTS[:4], {**GREEDY, **spec})
        outs += engine.generate(PROMPTS[4], {**SAMPLED, **spec, "n": 4})
        for text in texts(outs):
            jsonschema.validate(json.loads(text), schema)
    assert engine.get_server_info()["grammar_active"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_outputs_fullmatch(engine, backend):
    for pattern in REGEXES:
        spec = {"regex": pattern, "grammar_backend": backend}
        outs = engine.generate(PROMPTS[:3], {**GREEDY, **spec})
        outs += engine.generate(PROMPTS[3], {**SAMPLED, **spec, "n": 3})
        for text in texts(outs):
            assert re.fullmatch(pattern, text), (pattern, text)


def test_ebnf_outputs_parse(engine):
    outs = engine.generate(PROMPTS[:4], {**GREEDY, "ebnf": ARITH_EBNF})
    outs += engine.generate(PROMPTS[4], {**SAMPLED, "ebnf": ARITH_EBNF, "n": 4})
    for text in texts(outs):
        tree = ast.parse(text, mode="eval")
        assert isinstance(eval(compile(tree, "<grammar>", "eval")), int), text


@pytest.mark.parametrize("backend", BACKENDS)
def test_choices_return_one_of_them(engine, backend):
    choices = ["red", "green", "grey", "blue sky", "a much longer answer"]
    outs = engine.generate(PROMPTS[:3], {**GREEDY, "choices": choices,
                                         "grammar_backend": backend})
    outs += engine.generate(PROMPTS[3], {**SAMPLED, "choices": choices, "n": 8,
                                         "grammar_backend": backend})
    assert all(text in choices for text in texts(outs))


def test_mask_touches_only_grammar_rows(path):
    """One bitmask for the batch: rows with a grammar get -inf on every token it disallows and
    keep the rest bit for bit; rows without one are not touched at all."""
    grammars = DirectScheduler(path).scheduler.grammars
    reqs = [Req(f"r{i}", [1, 2], SamplingParams(regex=regex)) for i, regex in
            enumerate([None, "[0-9]+", None, "(yes|no)"])]
    for req in reqs:
        grammars.submit(req)
    while grammars.has_pending:
        grammars.wait(1.0)
        assert grammars.poll() == []
    logits = torch.randn(4, grammars.vocab_size)  # [B, V]
    masked = logits.clone()
    grammars.apply_mask(reqs, masked)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    for i in (1, 3):
        allowed = torch.isfinite(masked[i])
        assert torch.equal(masked[i][allowed], logits[i][allowed])
        for token in allowed.nonzero()[:, 0].tolist():
            assert reqs[i].grammar.copy().accept_token(token)
        for token in (~allowed).nonzero()[:40, 0].tolist():
            assert not reqs[i].grammar.copy().accept_token(token)
        assert 0 < allowed.sum() < grammars.vocab_size // 4
    for req in reqs:
        grammars.release(req)
    assert grammars.num_active == 0


# --- invalid grammars --------------------------------------------------------------------------


@pytest.mark.parametrize("params, message", [
    ({"json_schema": '{"type": "object", "properties": '}, "json_schema"),
    ({"json_schema": json.dumps({"type": "string", "format": "iri"}),
      "grammar_backend": "outlines"}, "#/format"),  # outlines' minimum is guarded now
    ({"regex": "(ab"}, "regex"),
    ({"ebnf": "root ::= (\"a\""}, "ebnf"),
    ({"ebnf": 'root ::= "a"', "grammar_backend": "outlines"}, "outlines"),
    ({"choices": []}, "choices"),
])
def test_invalid_grammar_raises_400_and_engine_keeps_serving(engine, params, message):
    with pytest.raises(GrammarError, match=message) as info:
        engine.generate(PROMPTS[:2], [{**GREEDY, **params}, GREEDY])
    assert isinstance(info.value, InvalidRequestError)  # a 400 at the HTTP edge
    out = engine.generate(PROMPTS[0], {**GREEDY, "regex": "[a-z]{4}"})
    assert re.fullmatch("[a-z]{4}", out["text"])
    assert engine.get_server_info()["num_waiting_reqs"] == 0


def test_bad_grammar_backend_names_rejected(path):
    with pytest.raises(InvalidRequestError, match="grammar_backend"):
        EngineArgs(model_path=path, grammar_backend="llguidance").resolve()
    with pytest.raises(InvalidRequestError, match="grammar_backend"):
        DirectScheduler(path).submit(PROMPTS[0], {"regex": "a", "grammar_backend": "nope"})


def test_scheduler_fails_a_bad_grammar_alone(path):
    """What the multi-process scheduler does (no client-side compile check): the request with a
    bad grammar ends as an abort with status 400 and the reason; the others are served."""
    d = DirectScheduler(path, debug_integrity=True)
    good = d.submit(PROMPTS[0], {**GREEDY, "regex": "[0-9]{5}"})
    bad = d.submit(PROMPTS[1], {**GREEDY, "regex": "([0-9"})
    plain = d.submit(PROMPTS[2], {**GREEDY, "max_new_tokens": 8, "ignore_eos": True})
    d.run()
    reason = d.builders[bad[0]].result()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "regex" in reason["message"]
    assert re.fullmatch("[0-9]{5}", d.builders[good[0]].result()["text"])
    assert len(d.output_ids(plain)[0]) == 8
    d.scheduler.check_integrity()


def test_compile_time_limit_fails_the_request(path):
    d = DirectScheduler(path, grammar_compile_timeout=0.05)
    slow = d.submit(PROMPTS[0], {**GREEDY, "json_schema": SLOW_SCHEMA})
    plain = d.submit(PROMPTS[1], {**GREEDY, "max_new_tokens": 4, "ignore_eos": True})
    d.run()
    reason = d.builders[slow[0]].result()["meta_info"]["finish_reason"]
    assert reason["status_code"] == 400 and "timed out after 0.05 s" in reason["message"]
    assert len(d.output_ids(plain)[0]) == 4


def test_a_compiling_grammar_does_not_hold_up_other_requests(path, monkeypatch):
    d = DirectScheduler(path)
    grammars = d.scheduler.grammars
    gate: Future = Future()
    real_submit = grammars.compiler.submit
    monkeypatch.setattr(grammars.compiler, "submit", lambda kind, spec, backend=None: gate)
    slow = d.submit(PROMPTS[0], {**GREEDY, "regex": "[a-c]{6}"})
    monkeypatch.setattr(grammars.compiler, "submit", real_submit)
    plain = d.submit(PROMPTS[1], {**GREEDY, "max_new_tokens": 6, "ignore_eos": True})
    while not d.builders[plain[0]].finished:
        d.step()
    assert d.builders[slow[0]].output_ids == [] and grammars.is_pending(d.scheduler.waiting.find(
        slow[0]))
    gate.set_result(real_submit("regex", "[a-c]{6}").result())
    d.run()
    assert re.fullmatch("[a-c]{6}", d.builders[slow[0]].result()["text"])
    d.scheduler.check_integrity()


# --- jump-forward ------------------------------------------------------------------------------


def test_jump_forward_leaves_outputs_unchanged(engine):
    params = [{**GREEDY, "json_schema": json.dumps(SCHEMAS[0])},
              {**GREEDY, "json_schema": json.dumps(SCHEMAS[1]), "grammar_backend": "outlines"},
              {**SAMPLED, "choices": ["alpha beta gamma", "alpha beta delta"]},
              {**SAMPLED, "regex": r"(yes|no), because [a-z ]{3,12}\."},
              {**GREEDY, "max_new_tokens": 20, "ignore_eos": True}]  # no grammar
    prompts = PROMPTS[:len(params)]
    runs = {}
    for enabled in (False, True):
        jump_forward(engine, enabled)
        before = engine.get_server_info()["decode_steps"]
        outs = engine.generate(prompts, params)
        runs[enabled] = (outs, engine.get_server_info()["decode_steps"] - before)
    (plain, plain_steps), (jumped, jumped_steps) = runs[False], runs[True]
    assert [o["output_ids"] for o in jumped] == [o["output_ids"] for o in plain]
    saved = [o["meta_info"].get("jump_forward_steps", 0) for o in jumped]
    assert all(saved[:4]) and saved[4] == 0
    assert not any(o["meta_info"].get("jump_forward_steps") for o in plain)
    assert jumped_steps < plain_steps


def test_forced_tokens_respect_max_new_tokens_and_report_steps(engine):
    # No merges cover these letters in the 512-token vocabulary: one spelling, token by token.
    answer = "QXZJQXZJQXZJ"
    out = engine.generate(PROMPTS[0], {**GREEDY, "choices": [answer]})
    assert out["text"] == answer and out["meta_info"]["finish_reason"]["type"] == "stop"
    # Only the first token and the final stop token (</s> or <|im_end|>: the model has two) are
    # sampled; every token in between is appended without a decode step.
    assert out["meta_info"]["jump_forward_steps"] == len(out["output_ids"]) - 2
    short = engine.generate(PROMPTS[0], {**GREEDY, "choices": [answer], "max_new_tokens": 5})
    assert short["output_ids"] == out["output_ids"][:5]
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert short["meta_info"]["jump_forward_steps"] == 4


def test_small_jumps_in_a_large_batch_are_fed_by_decode_steps(engine):
    """Forced tokens become one extend only when a step holds at least one per request; fewer
    are fed by decode steps (no step saved), with the same outputs either way."""
    grammar = {**GREEDY, "choices": ["QXZ"]}  # Q sampled, X and Z forced, then a stop sampled
    plain = {**GREEDY, "max_new_tokens": 24, "ignore_eos": True}
    alone = engine.generate(PROMPTS[0], grammar)
    assert alone["text"] == "QXZ" and alone["meta_info"]["jump_forward_steps"] == 2
    batch = [grammar] + [plain] * 6
    jumped = engine.generate(PROMPTS[:7], batch)
    assert "jump_forward_steps" not in jumped[0]["meta_info"]  # 2 forced tokens < 7 requests
    jump_forward(engine, False)
    stepped = engine.generate(PROMPTS[:7], batch)
    jump_forward(engine, True)
    assert [o["output_ids"] for o in jumped] == [o["output_ids"] for o in stepped]
    assert jumped[0]["output_ids"] == alone["output_ids"]


def test_grammar_end_wins_over_min_new_tokens(engine):
    for enabled in (False, True):
        jump_forward(engine, enabled)
        out = engine.generate(PROMPTS[1], {**GREEDY, "choices": ["yes", "no"],
                                           "min_new_tokens": 10})
        assert out["text"] in ("yes", "no")
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    jump_forward(engine, True)


def test_logprobs_reflect_the_constraint(engine):
    params = {**GREEDY, "json_schema": json.dumps(SCHEMAS[0])}
    kw = {"return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [7, 8]}
    runs = {}
    for enabled in (False, True):
        jump_forward(engine, enabled)
        runs[enabled] = engine.generate(PROMPTS[2], params, **kw)
    jump_forward(engine, True)
    for out in runs.values():
        meta = out["meta_info"]
        entries = meta["output_token_logprobs"]
        assert [e[1] for e in entries] == out["output_ids"]
        assert all(e[0] <= 0.0 for e in entries)
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) \
            == len(entries)
        for (lp, tok, _), top in zip(entries, meta["output_top_logprobs"]):
            assert top[0][1] == tok and top[0][0] == pytest.approx(lp)  # greedy: top-1
    on, off = runs[True]["meta_info"], runs[False]["meta_info"]
    assert on["jump_forward_steps"] > 0
    # A forced token is the only one the mask leaves: logprob exactly 0 either way.
    assert [e[0] for e in on["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in off["output_token_logprobs"]], abs=1e-5)
    assert sum(e[0] == 0.0 for e in off["output_token_logprobs"]) >= on["jump_forward_steps"]


# --- streaming, chunked prefill, retraction, abort ----------------------------------------------


def test_streaming_chunks_build_a_valid_document(engine):
    async def stream() -> list[dict]:
        it = await engine.async_generate(PROMPTS[3], {**GREEDY, "json_schema": json.dumps(
            SCHEMAS[1])}, stream=True)
        return [chunk async for chunk in it]

    chunks = asyncio.run(stream())
    assert len(chunks) > 2
    for earlier, later in zip(chunks, chunks[1:]):
        assert later["output_ids"][:len(earlier["output_ids"])] == earlier["output_ids"]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(final["text"]), SCHEMAS[1])
    assert final["meta_info"]["jump_forward_steps"] > 0


def test_chunked_prefill_with_a_grammar(engine, path):
    prompt = " ".join(PROMPTS) * 3
    params = {**GREEDY, "json_schema": json.dumps(SCHEMAS[0])}
    whole = engine.generate(prompt, params)
    d = DirectScheduler(path, chunked_prefill_size=16, disable_radix_cache=True)
    rids = d.submit(prompt, params)
    d.run()
    assert d.scheduler.stats["prefill_steps"] > 3
    assert d.output_ids(rids) == [whole["output_ids"]]


def test_retraction_keeps_the_matcher(engine, path):
    params = {**GREEDY, "json_schema": json.dumps(SCHEMAS[0])}
    alone = [o["output_ids"] for o in engine.generate(PROMPTS[:3], params)]
    d = DirectScheduler(path, debug_integrity=True)
    rids = d.submit(PROMPTS[:3], params)
    for _ in range(8):
        d.step()
    victim = d.scheduler.running[1]
    assert victim.grammar is not None and victim.output_ids
    d.scheduler.retract(victim)
    d.run()
    assert victim.retractions == 1
    assert d.output_ids(rids) == alone
    d.scheduler.check_integrity()


def test_abort_releases_matchers_and_pending_compiles(path, monkeypatch):
    d = DirectScheduler(path)
    grammars = d.scheduler.grammars
    running = d.submit(PROMPTS[:2], {**GREEDY, "json_schema": json.dumps(SCHEMAS[0])})
    for _ in range(100_000):  # until both compiles are done (a busy machine takes more steps)
        if grammars.num_active == 2:
            break
        d.step()
    assert grammars.num_active == 2
    d.scheduler.abort(running[0])
    gate: Future = Future()
    monkeypatch.setattr(grammars.compiler, "submit", lambda kind, spec, backend=None: gate)
    pending = d.submit(PROMPTS[2], {**GREEDY, "regex": "x+"})
    d.step()
    assert grammars.num_active == 1 and grammars.has_pending
    d.scheduler.abort(pending[0])
    assert gate.cancelled() and not grammars.has_pending
    d.run()
    for rid in (running[0], pending[0]):
        reason = d.builders[rid].result()["meta_info"]["finish_reason"]
        assert reason == {"type": "abort", "message": "aborted", "status_code": 499}
    assert grammars.num_active == 0
    d.scheduler.check_integrity()


def test_json_whitespace_is_bounded(path):
    d = DirectScheduler(path, grammar_any_whitespace=True)
    schema = SCHEMAS[0]
    rids = d.submit(PROMPTS[:4], {**SAMPLED, "max_new_tokens": 400,
                                  "json_schema": json.dumps(schema)})
    d.run()
    loose = [d.builders[r].result()["text"] for r in rids]
    for text in loose:
        jsonschema.validate(json.loads(text), schema)
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # whitespace between elements
        assert max((len(m) for m in re.findall(r"\s+", outside)), default=0) <= 24
    assert any(re.search(r"\s{2,}|\n", re.sub(r'"(?:[^"\\]|\\.)*"', "", t)) for t in loose)


def test_multiprocess_engine_constrains_and_fails_alone(path):
    """Across the process boundary a bad grammar is refused by the scheduler with a 400, which
    the tokenizer manager raises as GrammarError (as in-process); the engine keeps serving,
    constrained requests validate and jump-forward is reported."""
    engine = Engine(path, mode="multiprocess", dtype="float32", debug_integrity=True)
    try:
        with pytest.raises(GrammarError, match="json_schema"):
            engine.generate(PROMPTS[1], {**GREEDY, "json_schema": '{"type": '})
        schema = SCHEMAS[0]
        outs = engine.generate([PROMPTS[0], PROMPTS[2]],
                               [{**GREEDY, "json_schema": json.dumps(schema)},
                                {**GREEDY, "regex": "[a-z]{3}"}])
        jsonschema.validate(json.loads(outs[0]["text"]), schema)
        assert outs[0]["meta_info"]["jump_forward_steps"] > 0
        assert re.fullmatch("[a-z]{3}", outs[1]["text"])
        engine.check_integrity()
    finally:
        engine.shutdown()

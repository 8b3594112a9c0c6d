"""The semantic guard in the decode loop (`results.py`, `GrammarManager`): a token the guard
rejects is banned and the row sampled again (same seed and position), logprobs come from the
final row, dead ends abort their request alone; plus the engine side of `json_schema_strict`.

Unit tests drive `ResultProcessor._guard` on hand-made logits with a fake matcher; engine tests
run the tiny random Llama with a fake guard (a matcher wrapper implementing `check_token`) and
with real schemas the constrained package's guard must enforce.
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from arborlm import Engine
from arborlm.errors import GrammarError
from arborlm.runtime.request import Req
from arborlm.runtime.sampling.sampler import process_logits, sample
from arborlm.runtime.sampling.sampling_batch import SamplingBatch
from arborlm.runtime.sampling_params import SamplingParams
from arborlm.runtime.scheduler import grammar_manager as gm
from arborlm.runtime.scheduler.grammar_manager import GrammarManager
from arborlm.runtime.scheduler.results import ResultProcessor, _row_batch
from tests.runtime.engine_helpers import PROMPTS, DirectScheduler

V = 32


class FakeMatcher:
    """What the guard needs of a matcher: `check_token` rejecting a fixed set of tokens."""

    def __init__(self, rejected: set[int]):
        self.rejected = rejected
        self.checked: list[int] = []

    def check_token(self, token: int) -> str | None:
        self.checked.append(token)
        return f"#/items/{token}: not allowed (uniqueItems at #/uniqueItems)" \
            if token in self.rejected else None

    def rejected_value_start(self) -> int | None:
        return None  # the rejected token holds the whole value: banned where it is

    def choice_before(self, end: int) -> int | None:
        return None  # no earlier choice: a position's dead end is the request's


def processor() -> ResultProcessor:
    hook = GrammarManager.__new__(GrammarManager)
    hook._bans, hook.guard_bans = {}, 0
    proc = ResultProcessor.__new__(ResultProcessor)
    proc.grammar_hook = hook
    return proc


def make_req(rejected: set[int], **params) -> Req:
    req = Req("r", [1, 2, 3], SamplingParams(json_schema="{}", **params), seed=7,
              return_logprob=True)
    req.grammar = FakeMatcher(rejected)
    return req


def guard(proc, reqs, logits):
    """Sample `logits` [B, V] for `reqs` as `_sample` does, then guard every row."""
    sb = SamplingBatch.build(reqs, V, ())
    logits = process_logits(logits.clone(), sb)
    out = sample(logits, sb)
    ids = out.next_ids.tolist()
    return [proc._guard(r, i, ids[i], logits, sb, out) for i, r in enumerate(reqs)], out, logits


def test_row_batch_samples_each_row_as_the_batch_does():
    torch.manual_seed(0)
    reqs = [make_req(set(), temperature=0.0), make_req(set(), temperature=0.9, top_p=0.8),
            make_req(set(), temperature=1.3, top_k=5, min_p=0.01)]
    for i, r in enumerate(reqs):
        r.seed = 100 + i
    logits = torch.randn(3, V)
    sb = SamplingBatch.build(reqs, V, ())
    batch = sample(logits, sb).next_ids.tolist()
    assert [int(sample(logits[i:i + 1], _row_batch(sb, i)).next_ids[0]) for i in range(3)] == batch


def test_greedy_ban_takes_the_next_best_and_logprobs_follow_the_final_row():
    proc = processor()
    logits = torch.arange(V, dtype=torch.float32)[None, :].clone()  # best V-1, then V-2, ...
    req = make_req({V - 1, V - 2}, temperature=0.0)
    (tok,), out, final = guard(proc, [req], logits)
    assert tok == V - 3 and req.grammar.checked == [V - 1, V - 2, V - 3] and not req.finished
    assert proc.grammar_hook.guard_bans == 2
    expected = torch.log_softmax(final[0], dim=-1)
    assert torch.isinf(expected[V - 1]) and torch.isinf(expected[V - 2])
    assert torch.equal(out.logprobs[0], expected)
    best_left = 1 / sum(math.exp(-k) for k in range(V - 2))  # softmax over 0..V-3
    assert abs(float(out.logprobs[0, tok].exp()) - best_left) < 1e-5


def test_seeded_resampling_is_the_draw_without_the_banned_tokens():
    """The token sampled again is the one the same seed and position draw from the same logits
    with the banned token removed: deterministic whatever else is in the batch."""
    torch.manual_seed(1)
    logits = torch.randn(1, V)
    plain = make_req(set(), temperature=1.0)
    first = int(sample(logits.clone(), SamplingBatch.build([plain], V, ())).next_ids[0])
    req = make_req({first}, temperature=1.0)
    other = make_req(set(), temperature=0.7)
    other.seed = 99
    (tok, _), _, _ = guard(processor(), [req, other], torch.cat([logits, torch.randn(1, V)]))
    banned = logits.clone()
    banned[0, first] = float("-inf")
    assert tok != first
    assert tok == int(sample(banned, SamplingBatch.build([plain], V, ())).next_ids[0])


def test_nothing_left_is_a_dead_end_that_names_the_reason():
    proc = processor()
    logits = torch.full((1, V), float("-inf"))
    logits[0, 4] = logits[0, 9] = 0.0  # what a grammar mask leaves
    req = make_req({4, 9}, temperature=0.0)
    guard(proc, [req], logits)
    reason = req.finished_reason
    assert reason.type == "abort" and reason.status_code == gm.GUARD_DEAD_END_STATUS
    assert reason.message.startswith("json_schema guard: #/items/")
    assert "uniqueItems" in reason.message and "no other token" in reason.message


def test_bans_are_bounded_per_position_and_per_request(monkeypatch):
    proc = processor()
    req = make_req(set(range(V)) - {0}, temperature=0.0)
    logits = torch.arange(V, dtype=torch.float32)[None, :].clone()
    guard(proc, [req], logits)
    assert req.finished_reason.type == "abort" and "retries ran out" in \
        req.finished_reason.message
    assert len(req.grammar.checked) == gm.MAX_GUARD_BANS_PER_STEP + 1
    monkeypatch.setattr(gm, "MAX_GUARD_BANS_PER_REQUEST", 3)
    proc = processor()
    req = make_req({V - 1, V - 2}, temperature=0.0)
    for _ in range(2):  # two positions of two bans each: the fourth ban is one too many
        guard(proc, [req], logits)
    assert req.finished and proc.grammar_hook.guard_bans == 3


# --- through the engine ------------------------------------------------------------------------

GREEDY = {"temperature": 0.0, "max_new_tokens": 60}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 60, "sampling_seed": 5}


@pytest.fixture(scope="module")
def path(make_tiny_model):
    return str(make_tiny_model("llama"))


class NoRepeat:
    """A matcher wrapper whose guard rejects a token that repeats the output's last character
    (what a grammar cannot say), so `[ab]{8}` must come out alternating."""

    def __init__(self, inner, tokenizer, req):
        self._inner, self._tok, self._req = inner, tokenizer, req

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def check_token(self, token: int) -> str | None:
        before = self._tok.decode(self._req.output_ids)
        after = self._tok.decode(self._req.output_ids + [token])
        added = after[len(before):]
        text = before[-1:] + added
        if any(a == b for a, b in zip(text, text[1:])):
            return f"#/{len(before)}: repeats a character"
        return None


class Never:
    """A matcher wrapper whose guard rejects every token but the stop tokens."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def check_token(self, token: int) -> str | None:
        return None if token in self._inner.stop_token_ids else "#: never satisfied (not at #/not)"

    def find_jump_forward_tokens(self, max_tokens):
        return []


def wrap_matchers(monkeypatch, grammars: GrammarManager, wrap) -> None:
    """Wrap each matcher `grammars.poll` hands out with `wrap(matcher, req)`."""
    real_poll = grammars.poll

    def poll():
        pending = list(grammars._pending)
        failed = real_poll()
        for req in pending:
            if req.grammar is not None and not isinstance(req.grammar, NoRepeat | Never):
                req.grammar = wrap(req.grammar, req)
        return failed

    monkeypatch.setattr(grammars, "poll", poll)


def count_bans(monkeypatch) -> list[int]:
    bans: list[int] = []
    real_ban = GrammarManager.ban

    def ban(self, req, n):
        bans.append(n)
        return real_ban(self, req, n)

    monkeypatch.setattr(GrammarManager, "ban", ban)
    return bans


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_guard_rejections_are_resampled_into_a_valid_output(engine, monkeypatch, params):
    wrap_matchers(monkeypatch, engine.scheduler.grammars,
                  lambda m, req: NoRepeat(m, engine.tokenizer, req))
    bans = count_bans(monkeypatch)
    before = engine.get_server_info()["grammar_guard_bans"]
    outs = engine.generate(PROMPTS[:3], {**params, "regex": "[ab]{8}"}, return_logprob=True,
                           top_logprobs_num=3)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        text = out["text"]
        assert len(text) == 8 and set(text) <= {"a", "b"}, text
        assert all(x != y for x, y in zip(text, text[1:])), text
        lps = out["meta_info"]["output_token_logprobs"]
        assert len(lps) == len(out["output_ids"])
        assert all(lp <= 0.0 for lp, _, _ in lps)
    assert bans, "the guard never rejected a token: the test shows nothing"
    assert engine.get_server_info()["grammar_guard_bans"] - before == len(bans)
    engine.check_integrity()


def test_a_guard_dead_end_aborts_that_request_alone(path, monkeypatch):
    d = DirectScheduler(path, debug_integrity=True)
    doomed_rid = []
    wrap_matchers(monkeypatch, d.scheduler.grammars,
                  lambda m, req: Never(m) if req.rid in doomed_rid else m)
    doomed = d.submit(PROMPTS[0], {**GREEDY, "regex": "[a-z]{3,40}"})
    doomed_rid.extend(doomed)
    good = d.submit(PROMPTS[1], {**GREEDY, "regex": "[0-9]{6}"})
    plain = d.submit(PROMPTS[2], {**GREEDY, "max_new_tokens": 12, "ignore_eos": True})
    d.run()
    reason = d.builders[doomed[0]].result()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert reason["message"].startswith("regex guard: #: never satisfied (not at #/not)")
    assert "retries ran out" in reason["message"] or "no other token" in reason["message"]
    assert d.builders[good[0]].result()["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(d.builders[good[0]].result()["text"]) == 6
    assert len(d.output_ids(plain)[0]) == 12
    assert d.scheduler.grammars.num_active == 0
    d.scheduler.check_integrity()


# --- with the constrained package's guard -------------------------------------------------------

# Strings of at most 2 characters, all different: a string that would close as a duplicate is
# banned there and continued instead (the guard bans at least once on these prompts).
UNIQUE = {"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True,
          "minItems": 3, "maxItems": 4}
NOT_EMPTY = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3,
                                                    "not": {"const": ""}}},
             "required": ["k"]}
# Never satisfiable: every string of at most 2 characters is one of at most 5.
NEVER = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 2,
                                                "not": {"maxLength": 5}}}, "required": ["k"]}


@pytest.fixture(scope="module")
def engine(path):
    engine = Engine(path, dtype="float32", debug_integrity=True)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("schema", [UNIQUE, NOT_EMPTY], ids=["uniqueItems", "not"])
def test_real_guard_keeps_outputs_valid(engine, monkeypatch, schema):
    calls: list[str] = []
    real_check = GrammarManager.check

    def check(req, token):
        reason = real_check(req, token)
        if reason is not None:
            calls.append(reason)
        return reason

    monkeypatch.setattr(GrammarManager, "check", staticmethod(check))
    spec = {"max_new_tokens": 40, "json_schema": json.dumps(schema)}
    outs = engine.generate(PROMPTS[:4], {**GREEDY, **spec})
    outs += engine.generate(PROMPTS[4], {**SAMPLED, **spec, "n": 8})
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        jsonschema.validate(json.loads(out["text"]), schema)
    if schema is UNIQUE:
        assert any("uniqueItems" in c for c in calls), calls
    engine.check_integrity()


def test_real_guard_dead_end_aborts_alone(engine):
    outs = engine.generate(PROMPTS[:3], [
        {**GREEDY, "json_schema": json.dumps(NEVER)},
        {**GREEDY, "json_schema": json.dumps(NOT_EMPTY)},
        {**GREEDY, "max_new_tokens": 10, "ignore_eos": True}])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert reason["message"].startswith("json_schema guard: ") and "#/properties/k/not" in \
        reason["message"], reason
    assert outs[0]["text"].startswith('{"k": "')
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(outs[1]["text"]), NOT_EMPTY)
    assert len(outs[2]["output_ids"]) == 10
    assert engine.get_server_info()["grammar_active"] == 0
    engine.check_integrity()


IRI = {"type": "object", "properties": {"link": {"type": "string", "format": "iri",
                                                  "maxLength": 8}}, "required": ["link"]}


def test_strict_refuses_and_non_strict_accepts(engine):
    """Neither xgrammar nor `jsonschema` checks format `iri`: strict (the default) refuses it
    naming its pointer; non-strict generates anyway."""
    with pytest.raises(GrammarError, match="#/properties/link/format"):
        engine.generate(PROMPTS[0], {**GREEDY, "json_schema": json.dumps(IRI)})
    out = engine.generate(PROMPTS[0], {**GREEDY, "json_schema": json.dumps(IRI),
                                       "json_schema_strict": False})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    assert set(json.loads(out["text"])) == {"link"}


def test_engine_reports_what_a_non_strict_schema_leaves_unenforced(engine):
    """`Engine` results carry the non-strict report too (`schema_report`), finished results and
    the last streamed chunk alike; strict requests carry none."""
    import asyncio

    params = {**GREEDY, "json_schema": json.dumps(IRI), "json_schema_strict": False}
    out = engine.generate(PROMPTS[0], params)
    meta = out["meta_info"]
    assert meta["json_schema_unenforced"] == ["#/properties/link/format (format 'iri' not "
                                              "checked)"], meta
    assert meta["json_schema_valid"] is True  # finished: an object with a short string link

    async def last_chunk() -> dict:
        chunks = [c async for c in await engine.async_generate(PROMPTS[0], params, stream=True)]
        return chunks[-1]

    last = asyncio.run(last_chunk())
    assert last["meta_info"]["json_schema_valid"] is True
    assert last["meta_info"]["json_schema_unenforced"] == meta["json_schema_unenforced"]
    strict = engine.generate(PROMPTS[0], {**GREEDY, "json_schema": json.dumps({"type": "object"})})
    assert "json_schema_unenforced" not in strict["meta_info"]

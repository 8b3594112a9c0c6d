"""One request failing inside the engine fails alone: a failure injected at each per-request
stage (adding, stop check, sampling parameters, grammar mask / accept / jump-forward, input and
output logprobs, detokenization) for one marked request, with others in flight in the same
batches, finishes that request with an abort (status 500, naming the stage); the others finish
with the tokens they get without the failure, and the KV pool and prefix cache stay consistent.
One stage is also injected into the scheduler *process* of a multi-process engine (through a
`sitecustomize` module its spawned children import at start-up)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from arborlm import Engine
from arborlm.runtime.response import ResponseBuilder
from arborlm.runtime.sampling.sampling_batch import SamplingBatch
from arborlm.runtime.scheduler.grammar_manager import GrammarManager
from arborlm.runtime.scheduler.results import ResultProcessor

MARK = "boom"
PROMPTS = ["The quick brown fox", "Once upon a time", "def add(a, b):", "1 2 3 4 5"]
RIDS = ["r0", MARK, "r2", "r3"]
BASE = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
AFTER = 2  # the marked request fails once it has this many output tokens


class Injected(RuntimeError):
    """The failure the tests inject."""


def _marked(req) -> bool:
    return req.rid == MARK and len(req.output_ids) >= AFTER


def _raise_for_marked(original, stage_of_req=lambda *a: a[1]):
    def wrapper(*args, **kwargs):
        if _marked(stage_of_req(*args)):
            raise Injected("injected")
        return original(*args, **kwargs)
    return wrapper


class _FailingMatcher:
    """A grammar matcher whose mask fails once the request has output (a proxy)."""

    def __init__(self, inner, req):
        self._inner, self._req = inner, req

    def fill_bitmask(self, mask, row):
        if _marked(self._req):
            raise Injected("injected")
        return self._inner.fill_bitmask(mask, row)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _fail_mask(mp: pytest.MonkeyPatch) -> None:
    original = GrammarManager.poll

    def poll(self):
        before = set(self._pending)
        failed = original(self)
        for req in before - set(self._pending):
            if req.rid == MARK and req.grammar is not None:
                req.grammar = _FailingMatcher(req.grammar, req)
        return failed
    mp.setattr(GrammarManager, "poll", poll)


def _fail_build(mp: pytest.MonkeyPatch) -> None:
    original = SamplingBatch.build.__func__

    def build(cls, reqs, *args, **kwargs):
        if any(_marked(r) for r in reqs):
            raise Injected("injected")
        return original(cls, reqs, *args, **kwargs)
    mp.setattr(SamplingBatch, "build", classmethod(build))


def _fail_attach(mp: pytest.MonkeyPatch) -> None:
    original = ResultProcessor.attach

    def attach(self, req):
        if req.rid == MARK:
            raise Injected("injected")
        return original(self, req)
    mp.setattr(ResultProcessor, "attach", attach)


def _fail_detokenizer(mp: pytest.MonkeyPatch) -> None:
    original = ResponseBuilder.add

    def add(self, out):
        if self.req.rid == MARK and len(self.output_ids) + len(out.new_token_ids) >= AFTER:
            raise Injected("injected")
        return original(self, out)
    mp.setattr(ResponseBuilder, "add", add)


def _fail_input_logprobs(mp: pytest.MonkeyPatch) -> None:
    original = ResultProcessor._input_logprobs

    def input_logprobs(self, req, *args):
        if req.rid == MARK:  # computed at prefill, before any output
            raise Injected("injected")
        return original(self, req, *args)
    mp.setattr(ResultProcessor, "_input_logprobs", input_logprobs)


def _patch(cls, name, stage_of_req=lambda *a: a[1], static=False):
    def apply(mp: pytest.MonkeyPatch) -> None:
        original = getattr(cls, name)
        wrapper = _raise_for_marked(original, stage_of_req)
        mp.setattr(cls, name, staticmethod(wrapper) if static else wrapper)
    return apply


STOPS = {"stop": ["never appears \x01"], "stop_regex": [r"\x02+\d"]}
GRAMMAR = {"regex": "[a-z ]{10}"}
# stage in the abort message -> (how to inject it, extra sampling params, generate kwargs)
STAGES = {
    "adding the request": (_fail_attach, STOPS, {}),
    "stop check": (_patch(ResultProcessor, "_check_stop", lambda *a: a[0], static=True),
                   STOPS, {}),
    "sampling parameters": (_fail_build, {}, {}),
    "grammar mask": (_fail_mask, GRAMMAR, {}),
    "grammar": (_patch(GrammarManager, "accept"), GRAMMAR, {}),
    "grammar jump-forward": (_patch(GrammarManager, "jump_forward"),
                             {"regex": "[a-z]{4}-abcdefgh"}, {}),
    "output logprobs": (_patch(ResultProcessor, "_output_logprobs"), {},
                        {"return_logprob": True, "top_logprobs_num": 2}),
    "input logprobs": (_fail_input_logprobs, {},
                       {"return_logprob": True, "logprob_start_len": 0}),
    "detokenizer": (_fail_detokenizer, STOPS, {}),
}


@pytest.fixture(scope="module")
def engine(make_tiny_model):
    engine = Engine(str(make_tiny_model("llama")), dtype="float32", debug_integrity=True,
                    num_continuous_decode_steps=1)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failing_stage_fails_only_its_request(engine, monkeypatch, stage):
    inject, extra, kwargs = STAGES[stage]
    params = {**BASE, **extra}
    expected = engine.generate(PROMPTS, params, rid=[f"base-{r}" for r in RIDS], **kwargs)
    inject(monkeypatch)
    outs = engine.generate(PROMPTS, params, rid=RIDS, **kwargs)
    monkeypatch.undo()
    failed = outs[RIDS.index(MARK)]["meta_info"]["finish_reason"]
    assert failed["type"] == "abort" and failed["status_code"] == 500, failed
    assert failed["message"].startswith(f"{stage} failed: Injected"), failed
    for i, rid in enumerate(RIDS):
        if rid != MARK:
            assert outs[i]["output_ids"] == expected[i]["output_ids"], rid
            assert outs[i]["meta_info"]["finish_reason"] == \
                expected[i]["meta_info"]["finish_reason"]
    engine.check_integrity()
    again = engine.generate(PROMPTS[1], params, **kwargs)  # the engine still serves
    assert again["output_ids"] == expected[1]["output_ids"]


SITECUSTOMIZE = textwrap.dedent(f"""
    # Written by tests/runtime/test_request_failures.py for the engine's spawned children.
    from arborlm.runtime.scheduler.results import ResultProcessor

    _original = ResultProcessor._check_stop

    def _check_stop(req, tok, check):
        if req.rid == {MARK!r} and len(req.output_ids) >= {AFTER}:
            raise RuntimeError("injected in the scheduler process")
        return _original(req, tok, check)

    ResultProcessor._check_stop = staticmethod(_check_stop)
""")


def test_a_failing_stage_in_the_scheduler_process_fails_only_its_request(
        engine, make_tiny_model, monkeypatch, tmp_path):
    expected = engine.generate(PROMPTS, {**BASE, **STOPS}, rid=[f"mp-{r}" for r in RIDS])
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", ":".join([str(tmp_path), *sys.path]))
    mp = Engine(str(make_tiny_model("llama")), mode="multiprocess", dtype="float32",
                debug_integrity=True, num_continuous_decode_steps=1)
    try:
        outs = mp.generate(PROMPTS, {**BASE, **STOPS}, rid=RIDS)
        failed = outs[RIDS.index(MARK)]["meta_info"]["finish_reason"]
        assert failed["type"] == "abort" and failed["status_code"] == 500, failed
        assert "stop check failed" in failed["message"], failed
        for i, rid in enumerate(RIDS):
            if rid != MARK:
                assert outs[i]["output_ids"] == expected[i]["output_ids"], rid
        mp.check_integrity()
        assert mp.healthy()
    finally:
        mp.shutdown()

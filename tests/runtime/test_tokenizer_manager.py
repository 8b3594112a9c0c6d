"""`TokenizerManager` over real sockets, with the test playing the scheduler and detokenizer.

No child processes: the test receives what the tokenizer manager sends on the scheduler's
address and answers on the detokenizer's, so routing, reply order and failure handling are
checked exactly and fast.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from arborlm.errors import EngineDeadError, GrammarError, InvalidRequestError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.runtime.ipc import IpcAddresses
from arborlm.runtime.messages import (
    AbortReq,
    BatchTextOutput,
    BatchTokenizedGenerateReq,
    ErrorOutput,
    FlushCacheReq,
    FlushCacheResp,
    LogprobChunk,
    TokenizedGenerateReq,
)
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.runtime.tokenizer_utils import load_tokenizer
from arborlm.runtime.zmq_queues import PullQueue, PushQueue


class Pipeline:
    """A tokenizer manager plus the scheduler's inbox and the detokenizer's outbox."""

    def __init__(self, path: str):
        config = EngineArgs(model_path=path, dtype="float32").resolve()
        self.addrs = IpcAddresses.create()
        self.tm = TokenizerManager(config, load_tokenizer(config.tokenizer_path),
                                   self.addrs.detokenizer_to_tokenizer)
        self.inbox = PullQueue(self.addrs.tokenizer_to_scheduler, bind=True)
        self.outbox = PushQueue(self.addrs.detokenizer_to_tokenizer, bind=False)
        self.tm.connect(0, self.addrs.tokenizer_to_scheduler, max_total_tokens=64)

    def received(self):
        msg = self.inbox.get(timeout=5)
        assert msg is not None, "nothing reached the scheduler's address"
        return msg

    def close(self) -> None:
        self.tm.close(EngineDeadError("test over"))
        self.inbox.close()
        self.outbox.close()
        self.addrs.cleanup()


@pytest.fixture
def pipe(make_tiny_model):
    p = Pipeline(str(make_tiny_model("llama")))
    yield p
    p.close()


def text_output(rids, texts, ids, reasons, logprobs=None) -> BatchTextOutput:
    n = len(rids)
    return BatchTextOutput(rids=rids, texts=texts, output_ids=ids, finished_reasons=reasons,
                           prompt_tokens=[3] * n, completion_tokens=[len(i) for i in ids],
                           cached_tokens=[0] * n, logprobs=logprobs or [None] * n,
                           matched_stops=[None] * n)


async def _next(agen):
    return await asyncio.wait_for(agen.__anext__(), 5)


def test_batch_is_sent_as_one_message_and_routed_by_rid(pipe):
    req = GenerateRequest(text=["a b", "c d"], sampling_params={"max_new_tokens": 2},
                          rid=["r0", "r1"], stream=True, return_logprob=True)

    async def run():
        events = pipe.tm.generate(req)
        first = asyncio.ensure_future(_next(events))
        sent = await asyncio.to_thread(pipe.received)
        lp = LogprobChunk(output_token_logprobs=[(-0.5, 40, None)])
        pipe.outbox.put(text_output(["r1", "r0"], ["x", "y"], [[40], [41]], [None, None],
                                    [lp, LogprobChunk()]))
        got = [await first, await _next(events)]
        pipe.outbox.put(text_output(["r0", "r1"], ["yz", "xz"], [[42], [43]],
                                    [{"type": "length", "length": 2}] * 2))
        got += [item async for item in events]
        return sent, got

    sent, got = asyncio.run(run())
    assert isinstance(sent, BatchTokenizedGenerateReq)
    assert [r.rid for r in sent.reqs] == ["r0", "r1"]
    assert all(isinstance(r, TokenizedGenerateReq) and r.seed is not None for r in sent.reqs)
    assert [(i, e["text"], e["output_ids"]) for i, e in got] == [
        (1, "x", [40]), (0, "y", [41]), (0, "yz", [41, 42]), (1, "xz", [40, 43])]
    assert got[0][1]["meta_info"]["output_token_logprobs"] == [[-0.5, 40, None]]
    assert got[3][1]["meta_info"]["output_token_logprobs"] == []  # only new entries
    assert got[3][1]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_invalid_request_raises_before_anything_is_sent(pipe):
    with pytest.raises(InvalidRequestError, match="KV cache holds only 64"):
        pipe.tm.generate(GenerateRequest(input_ids=[5] * 100))
    assert pipe.inbox.get(timeout=0.2) is None


def _answer_with_error(pipe, req: GenerateRequest, error: ErrorOutput):
    async def run():
        events = pipe.tm.generate(req)
        first = asyncio.ensure_future(_next(events))
        await asyncio.to_thread(pipe.received)
        pipe.outbox.put(error)
        return await first

    return asyncio.run(run())


def test_error_output_ends_the_request_and_aborts_it(pipe):
    error = ErrorOutput(rid="e1", message="detokenizer: boom", status_code=500)
    index, event = _answer_with_error(pipe, GenerateRequest(text="hi", rid="e1"), error)
    assert event["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "detokenizer: boom", "status_code": 500}
    assert pipe.received() == AbortReq(rid="e1")


@pytest.mark.parametrize("params,error,param,expected", [
    ({}, InvalidRequestError, None, None),
    ({}, InvalidRequestError, "top_k", "top_k"),
    ({"regex": "("}, GrammarError, None, "regex")])
def test_refusal_before_any_output_raises(pipe, params, error, param, expected):
    """A 400 from the scheduler before anything was generated raises, as in-process, naming
    the field the scheduler named."""
    req = GenerateRequest(text="hi", rid="e2", sampling_params=params)
    refusal = ErrorOutput(rid="e2", message="refused", status_code=400, param=param)
    with pytest.raises(error, match="refused") as info:
        _answer_with_error(pipe, req, refusal)
    assert info.value.param == expected


def test_closing_the_stream_early_aborts_the_request(pipe):
    async def run():
        events = pipe.tm.generate(GenerateRequest(text="hi", rid="c1", stream=True))
        first = asyncio.ensure_future(_next(events))
        await asyncio.to_thread(pipe.received)
        pipe.outbox.put(text_output(["c1"], ["a"], [[40]], [None]))
        await first
        await events.aclose()

    asyncio.run(run())
    assert pipe.received() == AbortReq(rid="c1")


def test_control_replies_resolve_in_send_order(pipe):
    async def run():
        first = asyncio.ensure_future(pipe.tm.flush_cache())
        second = asyncio.ensure_future(pipe.tm.flush_cache())
        await asyncio.sleep(0)
        sent = [await asyncio.to_thread(pipe.received) for _ in range(2)]
        pipe.outbox.put(FlushCacheResp(ok=False, message="busy"))
        pipe.outbox.put(FlushCacheResp(ok=True, message="flushed"))
        return sent, await first, await second

    sent, first, second = asyncio.run(run())
    assert sent == [FlushCacheReq(), FlushCacheReq()]
    assert (first, second) == ((False, "busy"), (True, "flushed"))


def test_callers_on_different_event_loops_get_their_own_events(pipe):
    results: dict[str, list] = {}

    def caller(rid: str, ready: threading.Event) -> None:
        async def run():
            events = pipe.tm.generate(GenerateRequest(text="hi", rid=rid))
            first = asyncio.ensure_future(_next(events))
            await asyncio.sleep(0)
            ready.set()
            results[rid] = [await first]

        asyncio.run(run())

    flags = {rid: threading.Event() for rid in ("t0", "t1")}
    threads = [threading.Thread(target=caller, args=(rid, f)) for rid, f in flags.items()]
    for t in threads:
        t.start()
    for f in flags.values():
        assert f.wait(5)
    assert {pipe.received().rid for _ in range(2)} == {"t0", "t1"}
    done = {"type": "length", "length": 1}
    pipe.outbox.put(text_output(["t1", "t0"], ["one", "zero"], [[41], [40]], [done, done]))
    for t in threads:
        t.join(5)
    assert results["t0"][0][1]["text"] == "zero" and results["t1"][0][1]["text"] == "one"


def test_fail_all_wakes_every_waiter_and_later_calls_raise(pipe):
    async def run():
        events = pipe.tm.generate(GenerateRequest(text="hi"))
        pending = asyncio.ensure_future(_next(events))
        flush = asyncio.ensure_future(pipe.tm.flush_cache())
        await asyncio.sleep(0.05)
        pipe.tm.fail_all(EngineDeadError("scheduler process died (exit code -9)"))
        outcomes = await asyncio.gather(pending, flush, return_exceptions=True)
        return [str(o) for o in outcomes if isinstance(o, EngineDeadError)]

    assert asyncio.run(run()) == ["scheduler process died (exit code -9)"] * 2
    with pytest.raises(EngineDeadError, match="exit code -9"):
        pipe.tm.generate(GenerateRequest(text="hi"))
    with pytest.raises(EngineDeadError):
        pipe.tm.abort("x")


def test_one_manager_fronts_two_replicas_and_one_can_go_down_alone(pipe):
    """Replica 1's scheduler has its own inbox; both replicas' detokenizers answer on the one
    socket (replies tagged with `dp_rank`). Requests go to the replica named, each replica's
    control replies resolve its own calls, and replica 1 going down fails only its calls: it
    is refused until connected again, while replica 0 serves throughout."""
    inbox1 = PullQueue(pipe.addrs.tokenizer_to_scheduler + "-1", bind=True)
    pipe.tm.connect(1, pipe.addrs.tokenizer_to_scheduler + "-1", max_total_tokens=64)
    done = {"type": "length", "length": 1}
    try:
        async def run():
            on1 = pipe.tm.generate(GenerateRequest(text="hi", rid="on1"), rank=1)
            on0 = pipe.tm.generate(GenerateRequest(text="hi", rid="on0"), rank=0)
            pending1, pending0 = (asyncio.ensure_future(_next(e)) for e in (on1, on0))
            info0 = asyncio.ensure_future(pipe.tm.flush_cache(0))
            info1 = asyncio.ensure_future(pipe.tm.flush_cache(1))
            got1 = [await asyncio.to_thread(inbox1.get, 5) for _ in range(2)]
            got0 = [await asyncio.to_thread(pipe.received) for _ in range(2)]
            pipe.outbox.put(FlushCacheResp(ok=True, message="one", dp_rank=1))
            pipe.outbox.put(FlushCacheResp(ok=True, message="zero", dp_rank=0))
            replies = (await info0, await info1)
            link = pipe.tm.disconnect(1, EngineDeadError("replica 1 died"))
            failed = await asyncio.gather(pending1, return_exceptions=True)
            pipe.outbox.put(text_output(["on0"], ["a"], [[40]], [done]))
            return got1, got0, replies, link, failed, await pending0

        got1, got0, replies, link, failed, event0 = asyncio.run(run())
        assert [m.rid for m in got1 if hasattr(m, "rid")] == ["on1"]
        assert [m.rid for m in got0 if hasattr(m, "rid")] == ["on0"]
        assert replies == ((True, "zero"), (True, "one"))
        assert [str(e) for e in failed] == ["replica 1 died"]
        assert event0[1]["text"] == "a"
        link.close()
        with pytest.raises(EngineDeadError, match="replica 1 died"):
            pipe.tm.generate(GenerateRequest(text="hi"), rank=1)
        assert pipe.tm.ranks() == [0]
        pipe.tm.connect(1, pipe.addrs.tokenizer_to_scheduler + "-1", max_total_tokens=64)
        assert pipe.tm.ranks() == [0, 1]
    finally:
        inbox1.close()

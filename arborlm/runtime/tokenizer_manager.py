"""`TokenizerManager`: the API process's end of the multi-process engine (1 or N replicas).

Callers (coroutines on any event loop, in any thread) hand it a `GenerateRequest`; it
normalizes, tokenizes and validates it exactly as the in-process client does (same checks, same
per-request seeds drawn from `random_seed`), sends its sequences to the scheduler process of
replica `rank` in one message (so they are queued together, as in-process), and yields the
sequences' events as the detokenizer's `BatchTextOutput`s come back. Each replica's scheduler
is reached through a link (`connect`, one per start of the replica's processes); every
replica's detokenizer sends to the one socket this manager binds at `recv_addr`, and tags its
control replies with its replica's `dp_rank`. Each sequence's events come from the same
`ResponseBuilder` the in-process client uses, fed the detokenizer's text (`add_text`), so both
engine modes answer alike.

A receiver thread owns the socket from the detokenizer and routes each entry to its request's
asyncio queue (`call_soon_threadsafe`, one call per event loop per message); control replies
(flush, server info, health) resolve each replica's futures in the order the requests were sent
to it, which its one-way pipeline preserves. A sequence the scheduler refuses before generating
anything (a 400: a grammar that does not compile, an invalid request) makes the call raise
`GrammarError` / `InvalidRequestError`, as the in-process client raises those before queueing.
`disconnect(rank, error)` ends the pending calls of one replica with a copy of `error` (the
multi-process client calls it when a child of that replica dies: `EngineDeadError`, or
`EngineRestartingError` while it restarts it), and later calls to that replica raise the same
at once until it is connected again; the other replicas carry on. `fail_all(error)` does that
for every replica, for good.

This module imports no model, scheduler or torch code: the API process stays light. Process
management (spawning, liveness, shutdown) is `MultiProcessClient`'s job.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import random
import threading
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from arborlm.errors import EngineDeadError, GrammarError, InvalidRequestError, MessageDecodeError
from arborlm.runtime.generate_request import GenerateRequest, SingleRequest, prepare_request
from arborlm.runtime.messages import (
    AbortReq,
    BatchTextOutput,
    BatchTokenizedGenerateReq,
    ErrorOutput,
    FlushCacheReq,
    FlushCacheResp,
    GetServerInfoReq,
    HealthCheckReq,
    HealthCheckResp,
    Message,
    ServerInfoResp,
    ShutdownReq,
    TokenizedGenerateReq,
)
from arborlm.runtime.response import ResponseBuilder, abort_event
from arborlm.runtime.zmq_queues import PullQueue, PushQueue

if TYPE_CHECKING:
    from arborlm.runtime.config import EngineConfig

logger = logging.getLogger(__name__)

RECV_POLL_S = 0.2  # the receiver thread rechecks its stop flag this often


class _Sequence:
    """One generated sequence as its caller sees it: its `ResponseBuilder` (fed the detokenizer
    process's entries), the replica it runs on, and where its events go."""

    def __init__(self, index: int, single: SingleRequest, prompt_ids: list[int],
                 loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, rank: int):
        self.index = index
        self.rank = rank
        self.single = single
        self.rid = single.rid
        self.loop = loop
        self.queue = queue
        self.builder = ResponseBuilder(single, None, prompt_ids)
        self.detached = False  # the caller stopped listening; events are dropped
        self.delivered = False  # an event of this sequence has reached its caller
        self.error_param: str | None = None  # the field a refusal names (`fail`)

    @property
    def finished(self) -> bool:
        return self.builder.finished

    def add(self, out: BatchTextOutput, i: int) -> dict[str, Any] | None:
        """Apply entry `i` of `out`; return the event to deliver (None: nothing to say yet)."""
        self.builder.add_text(out, i)
        return self.builder.event()

    def item(self, event: dict[str, Any]) -> tuple[int, dict[str, Any]] | InvalidRequestError:
        """What the caller's queue gets for `event`: (index, event), or the error to raise when
        the scheduler refused the request (a 400 abort before anything was generated: a grammar
        that does not compile, an invalid request) — the in-process client raises those before
        queueing the request."""
        reason = event["meta_info"]["finish_reason"]
        if not self.delivered and not self.builder.output_ids and reason is not None \
                and reason["type"] == "abort" and reason.get("status_code") == 400:
            grammar = self.single.sampling_params.grammar
            if grammar is not None:
                return GrammarError(reason["message"], param=grammar[0])
            return InvalidRequestError(reason["message"], param=self.error_param)
        self.delivered = True
        return self.index, event

    def fail(self, message: str, status_code: int,
             param: str | None = None) -> dict[str, Any] | None:
        self.error_param = param
        return self.builder.fail(message, status_code)


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class TokenizerManager:
    def __init__(self, config: EngineConfig, tokenizer: Any, recv_addr: str,
                 random_seed: int = 0):
        self.config = config
        self.tokenizer = tokenizer
        self.max_total_tokens = 0  # the schedulers' figure, given to `connect`
        self._recv = PullQueue(recv_addr, bind=True)
        # One lock orders sends with the links, the table of sequences and the reply futures.
        self._lock = threading.RLock()
        self._links: dict[int, PushQueue] = {}  # replica -> its scheduler's socket
        self._down: dict[int, EngineDeadError] = {}  # replica -> why it has no link
        self._seqs: dict[str, _Sequence] = {}
        self._replies: dict[tuple[type, int], deque[Future]] = {}
        self._seeds = random.Random(random_seed)
        self._error: EngineDeadError | None = None  # closed for good
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, daemon=True,
                                        name="arborlm-tokenizer-manager")
        self._thread.start()

    # --- replicas -----------------------------------------------------------------------------

    def connect(self, rank: int, send_addr: str, max_total_tokens: int) -> None:
        """Replica `rank`'s scheduler is up at `send_addr` with a KV pool of `max_total_tokens`
        tokens: route its calls there from now on."""
        with self._lock:
            assert rank not in self._links, rank
            self._links[rank] = PushQueue(send_addr, bind=False)
            self._down.pop(rank, None)
            self.max_total_tokens = max_total_tokens

    def disconnect(self, rank: int, error: EngineDeadError) -> PushQueue | None:
        """Replica `rank`'s processes stop: end its pending calls with `error` (later calls to
        it raise it at once). Returns its link, still open, for a last `ShutdownReq`; the
        caller closes it."""
        with self._lock:
            self._down[rank] = error
            link = self._links.pop(rank, None)
            seqs = [seq for seq in self._seqs.values() if seq.rank == rank]
            for seq in seqs:
                del self._seqs[seq.rid]
            futures = [f for (_, r), q in self._replies.items() if r == rank for f in q]
            for (_, r), q in self._replies.items():
                if r == rank:
                    q.clear()
        self._fail(seqs, futures, error)
        return link

    def ranks(self) -> list[int]:
        """The replicas connected now."""
        with self._lock:
            return sorted(self._links)

    # --- requests -----------------------------------------------------------------------------

    def prepare(self, req: GenerateRequest) -> list[tuple[SingleRequest, list[int]]]:
        """Normalize, tokenize and validate every sequence (raises before anything is sent)."""
        return prepare_request(req, self.tokenizer, context_length=self.config.model.context_length,
                               max_total_tokens=self.max_total_tokens,
                               vocab_size=self.config.model.vocab_size)

    def generate(self, req: GenerateRequest, rank: int = 0
                 ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(sequence index, event) pairs, as `EngineClient.generate` specifies, from replica
        `rank`; bad input and a dead replica raise here, before anything is sent."""
        self.check_alive(rank)
        return self.generate_prepared(self.prepare(req), rank)

    async def generate_prepared(self, prepared: list[tuple[SingleRequest, list[int]]],
                                rank: int = 0) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """`generate` for sequences already tokenized and validated by `prepare`."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        seqs = [_Sequence(i, s, ids, loop, events, rank) for i, (s, ids) in enumerate(prepared)]
        msgs = [self._tokenized(s, ids) for s, ids in prepared]
        self._submit(seqs, msgs, rank)
        pending = len(seqs)
        try:
            while pending:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                index, event = item
                if event["meta_info"]["finish_reason"] is not None:
                    pending -= 1
                yield index, event
        finally:
            if pending:
                self._detach(seqs)

    def _tokenized(self, single: SingleRequest, ids: list[int]) -> TokenizedGenerateReq:
        seed = single.sampling_params.sampling_seed
        if seed is None:
            with self._lock:
                seed = self._seeds.getrandbits(62)
        return TokenizedGenerateReq(
            rid=single.rid, input_ids=ids, sampling_params=dataclasses.asdict(
                single.sampling_params), return_logprob=single.return_logprob,
            logprob_start_len=single.logprob_start_len, top_logprobs_num=single.top_logprobs_num,
            token_ids_logprob=single.token_ids_logprob,
            return_text_in_logprobs=single.return_text_in_logprobs, stream=single.stream,
            extra_key=single.extra_key, priority=single.priority, seed=seed)

    def _submit(self, seqs: list[_Sequence], msgs: list[TokenizedGenerateReq], rank: int) -> None:
        """Register the sequences and send them to replica `rank` in one message (queued
        together, as in-process); an id already in flight gets the in-process client's
        duplicate-id answer."""
        batch = []
        with self._lock:
            self.check_alive(rank)
            for seq, msg in zip(seqs, msgs):
                if seq.rid in self._seqs:  # answered as the in-process client answers it
                    seq.queue.put_nowait(
                        (seq.index, abort_event(seq.rid, f"duplicate request id {seq.rid!r}")))
                    continue
                self._seqs[seq.rid] = seq
                batch.append(msg)
            if len(batch) == 1:
                self._links[rank].put(batch[0])
            elif batch:
                self._links[rank].put(BatchTokenizedGenerateReq(reqs=batch))

    def _detach(self, seqs: list[_Sequence]) -> None:
        """The caller left early: drop its events and abort what is still running."""
        with self._lock:
            for seq in seqs:
                if self._seqs.get(seq.rid) is seq:
                    seq.detached = True
                    link = self._links.get(seq.rank)
                    if link is not None:
                        link.put(AbortReq(rid=seq.rid))

    def abort(self, rid: str | None = None, abort_all: bool = False,
              ranks: list[int] | None = None) -> None:
        """Abort `rid` (or everything) on replicas `ranks` (default: every connected one; a
        replica that does not know `rid` ignores it)."""
        with self._lock:
            for rank in self._links if ranks is None else ranks:
                self.check_alive(rank)
                self._links[rank].put(AbortReq(rid=rid, abort_all=abort_all))
            if not self._links:
                self.check_alive(0 if ranks is None else ranks[0])

    # --- control ------------------------------------------------------------------------------

    def _ask(self, msg: Message, reply: type, rank: int) -> Future:
        fut: Future = Future()
        with self._lock:
            self.check_alive(rank)
            self._replies.setdefault((reply, rank), deque()).append(fut)
            self._links[rank].put(msg)
        return fut

    async def flush_cache(self, rank: int = 0) -> tuple[bool, str]:
        return await asyncio.wrap_future(self._ask(FlushCacheReq(), FlushCacheResp, rank))

    async def server_info(self, rank: int = 0) -> dict[str, Any]:
        return await asyncio.wrap_future(self._ask(GetServerInfoReq(), ServerInfoResp, rank))

    async def health_check(self, rank: int = 0) -> bool:
        """A round trip through replica `rank`'s scheduler and detokenizer."""
        return await asyncio.wrap_future(self._ask(HealthCheckReq(), HealthCheckResp, rank))

    # --- liveness -----------------------------------------------------------------------------

    def check_alive(self, rank: int = 0) -> None:
        """Raise why replica `rank` cannot take calls (closed, down, or never connected)."""
        error = self._error or self._down.get(rank)
        if error is None and rank not in self._links:
            error = EngineDeadError(f"engine replica {rank} is not connected")
        if error is not None:
            raise copy.copy(error)  # each raise gets its own traceback

    def fail_all(self, error: EngineDeadError) -> None:
        """End every pending call of every replica with `error`; later calls raise it at once."""
        with self._lock:
            if self._error is None:
                self._error = error
            seqs = list(self._seqs.values())
            self._seqs.clear()
            futures = [f for q in self._replies.values() for f in q]
            self._replies.clear()
        self._fail(seqs, futures, error)

    def _fail(self, seqs: list[_Sequence], futures: list[Future], error: EngineDeadError) -> None:
        for seq in seqs:
            if not seq.detached:
                _call_in(seq.loop, [(seq.queue, copy.copy(error))])
        for fut in futures:
            if not fut.done():
                fut.set_exception(copy.copy(error))

    def close(self, error: EngineDeadError) -> None:
        """Fail what is pending, stop the receiver thread, close the sockets."""
        self.fail_all(error)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._recv.close()
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()

    # --- receiver thread ----------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self._recv.get(timeout=RECV_POLL_S)
            except MessageDecodeError:
                logger.exception("undecodable message from the detokenizer dropped")
                continue
            if msg is None or isinstance(msg, ShutdownReq):  # a replica's last message
                continue
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001 - keep routing for everyone else
                logger.exception("routing a %s failed", type(msg).__name__)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, BatchTextOutput):
            self._route(msg)
        elif isinstance(msg, ErrorOutput):
            self._route_error(msg)
        elif isinstance(msg, FlushCacheResp):
            self._reply(msg, (msg.ok, msg.message))
        elif isinstance(msg, ServerInfoResp):
            self._reply(msg, msg.info)
        elif isinstance(msg, HealthCheckResp):
            self._reply(msg, msg.ok)
        else:
            logger.warning("tokenizer manager ignores unexpected %s", type(msg).__name__)

    def _route(self, out: BatchTextOutput) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for i, rid in enumerate(out.rids):
                seq = self._seqs.get(rid)
                if seq is None:
                    continue
                event = seq.add(out, i)
                if seq.finished:
                    del self._seqs[rid]
                if event is not None and not seq.detached:
                    by_loop.setdefault(seq.loop, []).append((seq.queue, seq.item(event)))
        for loop, items in by_loop.items():
            _call_in(loop, items)

    def _route_error(self, err: ErrorOutput) -> None:
        with self._lock:
            seq = self._seqs.pop(err.rid, None)
            if seq is None:
                return
            event = seq.fail(err.message, err.status_code, err.param)
            link = self._links.get(seq.rank)
            if link is not None:  # it may still run in the scheduler (a detokenizer error)
                link.put(AbortReq(rid=err.rid))
        if event is not None and not seq.detached:
            _call_in(seq.loop, [(seq.queue, seq.item(event))])

    def _reply(self, msg: FlushCacheResp | ServerInfoResp | HealthCheckResp, value: Any) -> None:
        with self._lock:
            waiting = self._replies.get((type(msg), msg.dp_rank))
            fut = waiting.popleft() if waiting else None
        if fut is None:
            logger.warning("unexpected %s of replica %d dropped", type(msg).__name__,
                           msg.dp_rank)
        elif not fut.done():
            fut.set_result(value)


def _call_in(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
        pass

"""`InProcessClient`: the scheduler in a background thread of the caller's process.

Callers (any thread, any event loop) tokenize and validate in their own thread (and await their
grammars' compiles, so a bad grammar raises `GrammarError` like other invalid input), then hand
the requests to the scheduler thread through a command queue. The scheduler thread runs
`drive_scheduler` (the scheduler process's loop too): it steps while there is work and blocks on
the queue when idle; each step's reports go to per-request `ResponseBuilder`s and from there,
as events, to the waiting caller's asyncio queue (`call_soon_threadsafe`); a builder that
raises ends its own request with an abort (500), the others go on. Torch releases the GIL
inside its kernels, so callers stay responsive while the model runs. Concurrent callers are
batched together, which is what makes the DSL's parallel programs fast in-process.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import random
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from arborlm.runtime.config import EngineArgs
from arborlm.runtime.engine_client import EngineClient
from arborlm.runtime.generate_request import GenerateRequest, SingleRequest, prepare_request
from arborlm.runtime.request import Req
from arborlm.runtime.response import ResponseBuilder, abort_event
from arborlm.runtime.scheduler.scheduler import Scheduler
from arborlm.runtime.scheduler_loop import drive_scheduler
from arborlm.runtime.tokenizer_utils import load_tokenizer

logger = logging.getLogger(__name__)

# Longest wait for a command while idle; the loop then tells the scheduler it idles.
IDLE_WAIT_S = 1.0


@dataclass
class _Sink:
    """Where one sequence's events go: an asyncio queue in the caller's loop."""

    index: int
    builder: ResponseBuilder
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def push(self, event: Any) -> bool:
        """Queue `event` for the caller; False where the caller's event loop has closed (the
        caller is gone: its request must end, nothing else)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True


class InProcessClient(EngineClient):
    def __init__(self, args: EngineArgs):
        self.args = args
        self.config = args.resolve()
        self.tokenizer = load_tokenizer(self.config.tokenizer_path)
        self._seeds = random.Random(args.random_seed)
        self._seed_lock = threading.Lock()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        # The scheduler (model, pools, compiled step) is built on its own thread, the only one
        # that runs the model: see `_start`.
        started: Future = Future()
        self._thread = threading.Thread(target=self._start, args=(started,),
                                        name="arborlm-scheduler", daemon=True)
        self._thread.start()
        started.result()  # waits for `self.scheduler`; raises what building it raised

    @property
    def max_total_tokens(self) -> int:
        return self._max_total_tokens

    # --- caller side --------------------------------------------------------------------------

    def prepare(self, req: GenerateRequest) -> list[tuple[SingleRequest, list[int]]]:
        """Normalize, tokenize and validate every sequence (raises before anything is queued)."""
        return prepare_request(req, self.tokenizer, context_length=self.config.model.context_length,
                               max_total_tokens=self.max_total_tokens,
                               vocab_size=self.config.model.vocab_size)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        self._check_alive()
        prepared = self.prepare(req)
        await self._compile_grammars(prepared)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        sinks = [_Sink(i, ResponseBuilder(s, self.tokenizer, ids), loop, events)
                 for i, (s, ids) in enumerate(prepared)]
        reqs = [self._make_req(s, ids) for s, ids in prepared]
        self._call(lambda: self._add(reqs, sinks))
        pending = len(sinks)
        try:
            while pending:
                index, event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                if event["meta_info"].get("finish_reason") is not None:
                    pending -= 1
                yield index, event
        finally:
            if pending:
                rids = [s.builder.req.rid for s in sinks if not s.builder.finished]
                self._call(lambda: [self.scheduler.abort(r) for r in rids])

    async def _compile_grammars(self, prepared: list[tuple[SingleRequest, list[int]]]) -> None:
        """Wait for the sequences' grammars to compile, off the scheduler thread, so that a bad
        one raises `GrammarError` (a 400) before anything is queued, as other invalid input
        does; the scheduler then finds them in the compile cache."""
        futures = [self.scheduler.grammars.compile(s.sampling_params) for s, _ in prepared]
        for future in futures:
            if future is not None:
                await asyncio.wrap_future(future)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._call(lambda: self.scheduler.abort(rid, abort_all))

    async def flush_cache(self) -> tuple[bool, str]:
        return await asyncio.wrap_future(self._ask(self.scheduler.flush_cache))

    async def server_info(self) -> dict[str, Any]:
        return await asyncio.wrap_future(self._ask(self.scheduler.server_info))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between steps and return its result (blocking)."""
        return self._ask(fn).result()

    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the scheduler thread and free the model and the KV pool now. The scheduler's
        parts refer to one another, so without the collection below they would wait for the
        next cyclic garbage collection: a process that starts engines one after another would
        hold every earlier pool meanwhile (and size each new pool from the little memory left)."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._commands.put(lambda: None)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self.__dict__.pop("scheduler", None)
                gc.collect()

    # --- scheduler thread ---------------------------------------------------------------------

    def _call(self, fn: Callable[[], None]) -> None:
        self._check_alive()
        self._commands.put(fn)

    def _ask(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)

        self._call(run)
        return fut

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine's scheduler thread died: {self._error!r}")
        if self._stopped.is_set():
            raise RuntimeError("the engine has been shut down")

    def _make_req(self, single: SingleRequest, ids: list[int]) -> Req:
        seed = single.sampling_params.sampling_seed
        if seed is None:
            with self._seed_lock:
                seed = self._seeds.getrandbits(62)
        return Req(single.rid, ids, single.sampling_params, return_logprob=single.return_logprob,
                   logprob_start_len=single.logprob_start_len,
                   top_logprobs_num=single.top_logprobs_num,
                   token_ids_logprob=single.token_ids_logprob, extra_key=single.extra_key,
                   seed=seed, priority=single.priority, stream=single.stream)

    def _add(self, reqs: list[Req], sinks: list[_Sink]) -> None:
        for req, sink in zip(reqs, sinks):
            if req.rid in self._sinks:
                sink.push((sink.index, abort_event(req.rid, f"duplicate request id {req.rid!r}")))
                continue
            self._sinks[req.rid] = sink
            self.scheduler.add_request(req)

    def _start(self, started: Future) -> None:
        """Build the scheduler here, then run it. Loading the model on the caller's thread
        would give that thread an OpenMP team of its own; with more OpenMP threads than cores,
        libgomp's workers stop spinning between parallel regions and every region pays for
        waking them, which roughly halves the speed of small steps (docs/serving.md, "On a
        CPU")."""
        try:
            self.scheduler: Scheduler = Scheduler(self.config, self.tokenizer)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            started.set_exception(e)
            return
        self._max_total_tokens = self.scheduler.max_total_tokens
        started.set_result(None)
        self._loop()

    def _loop(self) -> None:
        try:
            drive_scheduler(self.scheduler, receive=self._run_commands, emit=self._dispatch,
                            stopped=self._stopped.is_set,
                            debug_integrity=self.args.debug_integrity)
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            logger.exception("scheduler thread died")
            self._error = e
            for sink in self._sinks.values():
                sink.push((sink.index, RuntimeError(f"the engine's scheduler failed: {e!r}")))
            self._sinks.clear()
        finally:
            self.scheduler.close()

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting for the first while `block`); False: none came."""
        try:
            self._commands.get(block=block, timeout=IDLE_WAIT_S if block else 0)()
        except queue.Empty:
            return False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            cmd()

    def _dispatch(self, outputs: list) -> None:
        for out in outputs:
            sink = self._sinks.get(out.rid)
            if sink is None:
                continue
            try:
                sink.builder.add(out)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                logger.exception("detokenizing %s failed", out.rid)
                del self._sinks[out.rid]
                if out.finished_reason is None:
                    self.scheduler.abort(out.rid)
                sink.push((sink.index, abort_event(out.rid, f"detokenizer failed: {e!r}", 500)))
                continue
            if sink.builder.finished:
                del self._sinks[out.rid]
            event = sink.builder.event()
            if event is not None and not sink.push((sink.index, event)):
                # The caller's loop closed before its cancellation's abort arrived here.
                self._sinks.pop(out.rid, None)
                if out.finished_reason is None:
                    self.scheduler.abort(out.rid)

"""The scheduler: continuous batching over one model runner.

One `step()` is: release finished requests (and those whose grammar failed to compile) →
schedule the next batch: a prefill batch of newly admitted requests and the ongoing chunked
prompt (`prefill.py`), else one step of every running request, retracting the newest ones when
the KV pool runs dry (`decode.py`) → forward (a greedy decode step may run several steps ahead
in one call, or verify speculative drafts: `arborlm.runtime.speculative`) → sample
(`results.py`) → advance the batch's requests (`after_step` of the module that scheduled it).
The `ScheduledBatch` carries what each phase needs from the one before.
Grammar work lives in `GrammarManager`; requests waiting for their grammar's compile stay in
the waiting queue but are not admitted until it is ready. The same class runs in-process
(`Engine`) and inside the scheduler process; it knows nothing of sockets, HTTP or text beyond
the stop-string checks.

Failures: work done for one request (its stop checker, grammar matcher, sampling parameters,
input / output logprobs, jump-forward) runs behind a per-request guard (`results.per_request`):
an exception there finishes that request alone with an abort (status 500, the stage and the
error in its message) and the step goes on for the others; its KV is released as for any
finished request. An exception in the batch's own work (the forward pass, the batched sampler,
the KV pool or the prefix cache) leaves the scheduler's state unknown and is not caught here:
in-process it ends the scheduler thread and every pending call fails with it; in the scheduler
process it ends the process (see `scheduler_process.py`).
"""

from __future__ import annotations

import os
import time
from typing import Any

from arborlm.errors import InvalidRequestError
from arborlm.radix_cache import create_prefix_cache
from arborlm.runtime.config import EngineConfig
from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.model_runner import ModelRunner
from arborlm.runtime.request import FinishReason, Req
from arborlm.runtime.scheduler.batch import ScheduledBatch
from arborlm.runtime.scheduler.decode import DecodeScheduler
from arborlm.runtime.scheduler.grammar_manager import GrammarManager
from arborlm.runtime.scheduler.kv_slots import KVSlots
from arborlm.runtime.scheduler.outputs import ReqOutput, make_output
from arborlm.runtime.scheduler.policy import WaitingQueue
from arborlm.runtime.scheduler.prefill import PrefillScheduler
from arborlm.runtime.scheduler.results import ResultProcessor, eos_token_ids, fail_request
from arborlm.runtime.speculative.speculator import create_speculator

# With nothing to run but grammars compiling, a step sleeps on the compiles this long at most.
GRAMMAR_WAIT_S = 0.005


class Scheduler:
    def __init__(self, config: EngineConfig, tokenizer: Any, runner: ModelRunner | None = None):
        self.config = config
        self.args = config.args
        self.runner = runner or ModelRunner(config)
        self.req_pool = self.runner.req_to_token_pool
        self.allocator = self.runner.allocator
        self.cache = create_prefix_cache(self.args.disable_radix_cache, self.req_pool,
                                         self.allocator, self.args.page_size)
        self.waiting = WaitingQueue(self.args.schedule_policy, self.cache)
        eos_ids = eos_token_ids(config, tokenizer)
        self.grammars = GrammarManager(self.args, tokenizer, self.runner.vocab_size, eos_ids)
        self.results = ResultProcessor(config, tokenizer, self.runner.vocab_size,
                                       eos_ids=eos_ids, grammar_hook=self.grammars)
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "retractions": 0,
                      "decode_steps": 0, "prefill_steps": 0, "jump_forward_steps": 0}
        kv = KVSlots(self.req_pool, self.allocator, self.cache, self.args.page_size)
        self.prefill = PrefillScheduler(self.args, self.waiting, kv, self.grammars, self.stats,
                                        finish=self._finish, emit=self._emit)
        self.decode = DecodeScheduler(config, self.waiting, kv, self.results, self.stats,
                                      finish=self._finish, emit=self._emit)
        self.speculator = create_speculator(config, kv, self.results, self.stats,
                                            tokenizer)
        self._outputs: list[ReqOutput] = []
        self._step_s = 0.0  # wall time of the last decode step (per step, when run ahead)

    # --- requests in and out ----------------------------------------------------------------

    @property
    def max_total_tokens(self) -> int:
        return self.allocator.total_size

    @property
    def running(self) -> list[Req]:
        """The decode set: requests whose prompt is prefilled (`DecodeScheduler.running`)."""
        return self.decode.running

    def add_request(self, req: Req) -> None:
        """Queue a validated request (see `GenerateRequest.normalize`). Should its per-request
        state fail to build (stop checker, grammar compile), it alone finishes with an abort:
        400 for an invalid request, 500 otherwise."""
        try:
            self.results.attach(req)
            self.grammars.submit(req)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            fail_request(req, "adding the request", e)
            if isinstance(e, InvalidRequestError):
                req.finished_reason = FinishReason.abort(str(e), 400)
            self._finish(req)
            return
        self.waiting.add(req)

    def abort(self, rid: str | None, abort_all: bool = False) -> None:
        """Finish a request (or all) with `abort`; running ones are released at the next step."""
        for req in list(self.waiting):
            if abort_all or req.rid == rid:
                req.finished_reason = FinishReason.abort("aborted", 499)
                self.waiting.remove([req])
                self._finish(req)
        chunked = self.prefill.chunked_req
        for req in self.running + ([chunked] if chunked else []):
            if (abort_all or req.rid == rid) and not req.finished:
                req.finished_reason = FinishReason.abort("aborted", 499)

    def retract(self, req: Req) -> None:
        """Move a running request back to the waiting queue (tests force this)."""
        self.decode.retract(req)

    def idle(self) -> None:
        """Nothing ran this turn of the loop: the model runner may keep its ranks alive."""
        self.runner.idle()

    def close(self) -> None:
        """Release what the model runner started (tensor-parallel ranks); safe twice."""
        self.runner.close()

    @property
    def is_idle(self) -> bool:
        return not self.running and not len(self.waiting) and self.prefill.chunked_req is None

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting)."""
        running = len(self.running) + (1 if self.prefill.chunked_req else 0)
        return running, len(self.waiting)

    # --- the loop -----------------------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        """Run one scheduling step; returns the reports produced by it."""
        self._release_finished()
        self._fail_grammar_errors()
        batch = self.prefill.schedule(self.running, self.decode.new_token_ratio)
        if batch is None and self.running:
            batch = self.decode.schedule()
        self.waiting.tick()
        if batch is None:
            if self.grammars.has_pending:
                self.grammars.wait(GRAMMAR_WAIT_S)
        elif batch.decoding:
            self._run_decode(batch)
        else:
            self.results.process(batch, self.runner.forward(self._forward_batch(batch)))
            self.decode.running.extend(self.prefill.after_step(batch))
        outputs, self._outputs = self._outputs, []
        return outputs

    def _run_decode(self, batch: ScheduledBatch) -> None:
        """One decode step of `batch`, or a run of greedy steps in one call when every request
        may take them and the pool has their slots (`DecodeScheduler.steps_ahead`); with
        speculative decoding, a verify step of the requests' drafts when some have one."""
        verify = self.speculator.draft(batch)
        if verify is not None:
            logits = self.runner.forward(self._forward_batch(verify))
            self.decode.after_verify(verify, self.speculator.verify(verify, logits))
            return
        fb = self._forward_batch(batch)
        others_waiting = bool(len(self.waiting)) or self.prefill.chunked_req is not None
        steps = self.decode.steps_ahead(batch, others_waiting=others_waiting,
                                        last_step_s=self._step_s)
        if steps > 1 and self.speculator.holds_back_run_ahead(batch):
            steps = 1
        start = time.perf_counter()
        slots = None
        if steps > 1 and self.runner.can_run_ahead(fb):
            slots = self.decode.slots_ahead(batch, steps)
        if slots is None:
            steps = 1
            self.results.process(batch, self.runner.forward(fb))
            self.decode.after_step(batch)
        else:
            self.decode.take_ahead(batch, self.runner.run_ahead(fb, slots).tolist())
        self._step_s = (time.perf_counter() - start) / steps

    def _forward_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        return batch.to_forward_batch(self.req_pool, self.runner.kv_pool, self.runner.device)

    # --- finishing ----------------------------------------------------------------------------

    def _release_finished(self) -> None:
        """Finish the requests aborted since the last step."""
        for req in self.decode.drop_finished():
            self._finish(req)
        chunked = self.prefill.drop_finished_chunked()
        if chunked is not None:
            self._finish(chunked)

    def _fail_grammar_errors(self) -> None:
        """Finish, each alone, the waiting requests whose grammar failed to compile."""
        failed = self.grammars.poll()
        if failed:
            self.waiting.remove(failed)
            for req in failed:
                self._finish(req)

    def _finish(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            # Forced tokens after the last computed one never needed a step of their own.
            req.jump_forward_steps += max(0, req.total_len - req.computed_len - 1)
            self.cache.cache_finished_req(req)
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        self.results.detach(req)
        self.grammars.release(req)
        self.speculator.release(req)
        self.stats["jump_forward_steps"] += req.jump_forward_steps
        self._emit(req)

    def _emit(self, req: Req) -> None:
        self._outputs.append(make_output(req))

    # --- maintenance --------------------------------------------------------------------------

    def flush_cache(self) -> tuple[bool, str]:
        if not self.is_idle:
            running, waiting = self.num_requests()
            return False, (f"cannot flush the cache while requests are pending "
                           f"({running} running, {waiting} waiting)")
        self.cache.reset()
        self.speculator.reset()
        return True, "cache flushed"

    def check_integrity(self) -> None:
        """Idle-time invariant: free slots + cached slots == all usable slots."""
        assert self.is_idle, "check_integrity runs only when idle"
        self.cache.check_integrity()
        assert self.cache.protected_size() == 0, "locked cache nodes while idle"
        free = self.allocator.available_size()
        cached = self.cache.total_size()
        assert free + cached == self.allocator.total_size, (
            f"KV slots leaked: free {free} + cached {cached} != total "
            f"{self.allocator.total_size}")
        assert self.req_pool.available_size() == self.req_pool.size, "req_to_token rows leaked"
        self.speculator.check_integrity()

    def server_info(self) -> dict[str, Any]:
        running, waiting = self.num_requests()
        prompt = self.stats["prefill_tokens"] + self.stats["cached_tokens"]
        return {
            "scheduler_pid": os.getpid(),
            "max_total_num_tokens": self.max_total_tokens,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "cache_hit_rate": self.stats["cached_tokens"] / prompt if prompt else 0.0,
            "available_kv_tokens": self.allocator.available_size(),
            "cached_kv_tokens": self.cache.total_size(),
            "deterministic_inference": self.runner.deterministic,
            **self.stats,
            **self.grammars.info(),
            **self.speculator.info(),
            "time": time.time(),
        }

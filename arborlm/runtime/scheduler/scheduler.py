"""The scheduler: continuous batching over one model runner.

One `step()` is: release finished requests (and those whose grammar failed to compile) →
schedule the next batch (a prefill batch of newly admitted requests and the ongoing chunked
prompt, else one decode step of every running request, retracting the newest ones when the KV
pool runs dry) → forward → sample → process results. Tokens a grammar forced (jump-forward) are
in a request's output before their KV is computed: a decode step computes them all at once as an
extend when there are enough of them, else each such request feeds one per decode step.
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

import logging
import os
import time
from typing import Any

import torch

from arborlm.errors import InvalidRequestError
from arborlm.radix_cache import create_prefix_cache
from arborlm.runtime.config import EngineConfig
from arborlm.runtime.forward_batch import ForwardMode
from arborlm.runtime.model_runner import ModelRunner
from arborlm.runtime.request import FinishReason, Req
from arborlm.runtime.scheduler.admission import PrefillBudget, reserved_tokens
from arborlm.runtime.scheduler.batch import ScheduledBatch
from arborlm.runtime.scheduler.grammar_manager import GrammarManager
from arborlm.runtime.scheduler.in_batch_prefix import InBatchPrefixFilter, NoInBatchFilter
from arborlm.runtime.scheduler.outputs import ReqOutput, make_output
from arborlm.runtime.scheduler.policy import WaitingQueue
from arborlm.runtime.scheduler.results import ResultProcessor, fail_request

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# Running requests make their KV findable by others every this many decode steps.
CACHE_RUNNING_EVERY = 32
# With nothing to run but grammars compiling, a step sleeps on the compiles this long at most.
GRAMMAR_WAIT_S = 0.005
# A decode step computes the forced tokens waiting in its requests as one extend once there are
# at least this many per request (the step then does at least twice a decode step's work):
# always for a lone request, the classic jump-forward win. Fewer are fed one per request per
# decode step, so that small jumps do not turn every decode step of a large batch into an
# extend (slower per row on CPU, and without the decode step's CUDA graph on GPU).
JUMP_EXTEND_PER_REQUEST = 1.0
# Continuous decode steps (`num_continuous_decode_steps` unset): a run of greedy decode steps in
# one call lasts about this long at most (a request arriving meanwhile waits that long), and is
# at most this many steps.
AHEAD_BUDGET_S = 0.05
AHEAD_MAX_STEPS = 8


class Scheduler:
    def __init__(self, config: EngineConfig, tokenizer: Any, runner: ModelRunner | None = None):
        self.config = config
        self.args = config.args
        self.runner = runner or ModelRunner(config)
        self.page_size = self.args.page_size
        self.req_pool = self.runner.req_to_token_pool
        self.allocator = self.runner.allocator
        self.cache = create_prefix_cache(self.args.disable_radix_cache, self.req_pool,
                                         self.allocator, self.page_size)
        self.waiting = WaitingQueue(self.args.schedule_policy, self.cache)
        self.in_batch = (NoInBatchFilter() if self.args.disable_radix_cache
                         else InBatchPrefixFilter())
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.results = ResultProcessor(config, tokenizer, self.runner.vocab_size)
        self.grammars = GrammarManager(self.args, tokenizer, self.runner.vocab_size,
                                       self.results.eos_ids)
        self.results.grammar_hook = self.grammars
        self._outputs: list[ReqOutput] = []
        self.decode_steps = 0
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "retractions": 0,
                      "decode_steps": 0, "prefill_steps": 0, "jump_forward_steps": 0}
        self._decoding = False  # the scheduled batch is a decode step (see `_schedule`)
        self._step_s = 0.0  # wall time of the last decode step (per step, when run ahead)

    # --- requests in and out ----------------------------------------------------------------

    @property
    def max_total_tokens(self) -> int:
        return self.allocator.total_size

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
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if (abort_all or req.rid == rid) and not req.finished:
                req.finished_reason = FinishReason.abort("aborted", 499)

    @property
    def is_idle(self) -> bool:
        return not self.running and not len(self.waiting) and self.chunked_req is None

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting)."""
        running = len(self.running) + (1 if self.chunked_req else 0)
        return running, len(self.waiting)

    # --- the loop -----------------------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        """Run one scheduling step; returns the reports produced by it."""
        self._release_finished()
        self._fail_grammar_errors()
        batch = self._schedule()
        if batch is not None:
            fb = batch.to_forward_batch(self.req_pool, self.runner.kv_pool,
                                        self._out_cache_loc, self.runner.device)
            steps = self._steps_ahead(batch) if self._decoding else 1
            start = time.perf_counter()
            if steps > 1 and self.runner.can_run_ahead(fb):
                steps = self._decode_ahead(batch, fb, steps)
            else:
                steps = 1
                self._process(batch, self.runner.forward(fb))
            if self._decoding:
                self._step_s = (time.perf_counter() - start) / steps
        elif self.grammars.has_pending:
            self.grammars.wait(GRAMMAR_WAIT_S)
        outputs, self._outputs = self._outputs, []
        return outputs

    def _schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        self._decoding = batch is None and bool(self.running)
        if self._decoding:
            batch = self._schedule_decode()
        self.waiting.tick()
        return batch

    def _process(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        self.results.process(batch, logits, self.runner.kv_pool)
        if self._decoding:
            self.stats["decode_steps"] += 1
            self._after_decode(batch)
        else:
            self.stats["prefill_steps"] += 1
            self._after_extend(batch)

    # --- prefill ------------------------------------------------------------------------------

    def _schedule_prefill(self) -> ScheduledBatch | None:
        if not len(self.waiting) and self.chunked_req is None:
            return None
        rem_reqs = min(self.args.max_running_requests - len(self.running),
                       self.req_pool.available_size())
        chunk = self.args.chunked_prefill_size
        reserved = sum(reserved_tokens(r) for r in self.running) * self.new_token_ratio
        budget = PrefillBudget(
            rem_total=self.allocator.available_size() + self.cache.evictable_size()
            - int(reserved),
            rem_input=self.args.max_prefill_tokens,
            rem_chunk=None if chunk in (None, -1) else chunk,
            rem_reqs=rem_reqs + (1 if self.chunked_req else 0),
            new_token_ratio=self.new_token_ratio, page_size=self.page_size)
        batch = ScheduledBatch(ForwardMode.EXTEND, [], [], [], [], [])
        slots: list[torch.Tensor] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            adm = budget.try_admit(req, req.computed_len)
            if adm is not None:
                self.chunked_req = None
                slots.append(self._add_to_batch(batch, req, req.computed_len, adm))
        self.in_batch.start_batch()
        for req in self.waiting.ordered():
            if self.grammars.is_pending(req):
                continue  # its grammar is compiling; the requests behind it go ahead
            evictable = self.cache.evictable_size()
            self._match_and_lock(req)
            if batch.reqs and self.in_batch.should_defer(req):
                self._unlock(req)  # its prefix will be cached after this step
                continue
            # Slots the lock just protected can no longer be evicted for this batch.
            budget.rem_total -= evictable - self.cache.evictable_size()
            adm = budget.try_admit(req, req.cached_len)
            if adm is None:
                self._unlock(req)
                break
            slots.append(self._add_to_batch(batch, req, req.cached_len, adm))
            self.in_batch.admitted(req)
            self.waiting.remove([req])
        if not batch.reqs:
            return None
        self._out_cache_loc = torch.cat(slots)
        return batch

    def _match_and_lock(self, req: Req) -> None:
        """Match the cached prefix of a waiting request and lock it."""
        limit = req.total_len - 1  # the last token is recomputed: its logits are needed
        if req.wants_input_logprobs and not req.input_logprobs_done:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        match = self.cache.match_prefix(req.fill_ids[:limit], req.extra_key)
        self.cache.lock(match.node)
        req.last_node = match.node
        req.prefix_slots = match.slots
        req.cached_len = req.computed_len = len(match.slots)

    def _unlock(self, req: Req) -> None:
        self.cache.unlock(req.last_node)
        req.last_node = None
        req.cached_len = req.computed_len = 0
        req.prefix_slots = torch.empty(0, dtype=torch.int64)

    def _add_to_batch(self, batch: ScheduledBatch, req: Req, prefix: int, adm: Any) -> torch.Tensor:
        """Give `req` a row (first time) and KV slots for its extend range."""
        if req.req_pool_idx is None:
            req.req_pool_idx = self.req_pool.alloc()
            assert req.req_pool_idx is not None, "budget admitted more requests than rows"
            self.req_pool.write(req.req_pool_idx, 0, req.prefix_slots)
            if req.retractions == 0:
                req.cached_tokens = req.cached_len
                self.stats["cached_tokens"] += req.cached_len
        end = prefix + adm.extend_len
        slots = self._alloc(req, prefix, end)
        self.req_pool.write(req.req_pool_idx, prefix, slots)
        req.is_chunked = adm.chunked
        batch.reqs.append(req)
        batch.prefix_lens.append(prefix)
        batch.extend_lens.append(adm.extend_len)
        batch.sample.append(not adm.chunked and req.sampling_params.max_new_tokens > 0)
        batch.input_logprob_positions.append(self._input_logprob_positions(req, prefix, end))
        self.stats["prefill_tokens"] += adm.extend_len
        return slots

    def _input_logprob_positions(self, req: Req, prefix: int, end: int) -> range:
        if not req.wants_input_logprobs or req.input_logprobs_done:
            return range(0)
        first = max(req.logprob_start_len - 1, 0)
        last = min(end, req.prompt_len - 1)  # logits at p give the logprob of token p+1
        return range(max(first, prefix), max(last, max(first, prefix)))

    def _alloc(self, req: Req, start: int, end: int) -> torch.Tensor:
        self._make_room(self.allocator.pages_needed(start, end) * self.page_size)
        last = 0  # the slot of position start - 1, read only where a page continues
        if start % self.page_size:
            last = int(self.req_pool.req_to_token[req.req_pool_idx, start - 1])
        return self.allocator.alloc_range(start, end, last)

    def _make_room(self, slots: int) -> None:
        """Evict cached prefixes until `slots` slots are free (as far as the cache allows)."""
        if self.allocator.available_size() < slots:
            self.cache.evict(slots - self.allocator.available_size())

    def _alloc_one_each(self, reqs: list[Req], positions: list[int]) -> torch.Tensor:
        """A slot for position `positions[i]` of each request `reqs[i]` (page size 1), written
        to their `req_to_token` rows: a decode step's, in one call each rather than per request
        (32 requests, timed: the step's scheduling 0.35 -> 0.15 ms)."""
        self._make_room(len(reqs))
        slots = self.allocator.alloc_slots(len(reqs))
        self.req_pool.write_one_each([r.req_pool_idx for r in reqs], positions, slots)
        return slots

    def _after_extend(self, batch: ScheduledBatch) -> None:
        for req, ext in zip(batch.reqs, batch.extend_lens):
            req.computed_len += ext
            req.check_lengths()
            if req.is_chunked:
                self.cache.cache_unfinished_req(req)
                self.chunked_req = req
                continue
            if req.sampling_params.max_new_tokens == 0 and not req.finished:
                req.finished_reason = FinishReason("length", length=0)
            if req.finished:
                self._finish(req)
            else:
                self.cache.cache_unfinished_req(req)
                self.running.append(req)
                self._emit(req)

    # --- decode -------------------------------------------------------------------------------

    def _schedule_decode(self) -> ScheduledBatch | None:
        """One step of every running request. A request whose newest tokens were forced by its
        grammar has several uncomputed ones: when the batch holds enough of those (see
        `JUMP_EXTEND_PER_REQUEST`), the step is an extend of every request's uncomputed tokens;
        otherwise it is a decode step of each request's oldest uncomputed token, and a request
        that still has more after it is not sampled (`ResultProcessor.process`)."""
        self._retract_until_fits()
        if not self.running:
            return None
        reqs = list(self.running)
        pending = [r.total_len - r.computed_len for r in reqs]
        jump = sum(pending) - len(reqs) >= JUMP_EXTEND_PER_REQUEST * len(reqs)
        extend = pending if jump else [1] * len(reqs)
        prefix = [r.computed_len for r in reqs]
        if not jump and self.page_size == 1:  # one new slot each: taken and written at once
            self._out_cache_loc = self._alloc_one_each(reqs, prefix)
        else:
            slots = [self._alloc(r, r.computed_len, r.computed_len + n)
                     for r, n in zip(reqs, extend)]
            for r, s in zip(reqs, slots):
                self.req_pool.write(r.req_pool_idx, r.computed_len, s)
            self._out_cache_loc = slots[0] if len(slots) == 1 else torch.cat(slots)
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        mode = ForwardMode.EXTEND if jump else ForwardMode.DECODE
        return ScheduledBatch(mode, reqs, prefix, extend, [True] * len(reqs),
                              [range(0)] * len(reqs))

    # --- continuous decode steps ---------------------------------------------------------------

    def _steps_ahead(self, batch: ScheduledBatch) -> int:
        """How many decode steps `batch` may run in one call (`num_continuous_decode_steps`):
        1 unless no request waits, the page size is 1 and every request samples greedily with
        nothing that changes its logits (penalties, bias, a grammar, bans before
        `min_new_tokens`) or wants logprobs; then as many as the option says (default: what
        fits in `AHEAD_BUDGET_S` at the last step's speed, at most `AHEAD_MAX_STEPS`), and no
        more than any request may still produce."""
        if batch.mode is not ForwardMode.DECODE or self.page_size != 1 or len(self.waiting) \
                or self.chunked_req is not None:
            return 1
        steps = self.args.num_continuous_decode_steps
        if steps is None:
            if self._step_s <= 0:
                return 1
            steps = max(1, min(AHEAD_MAX_STEPS, int(AHEAD_BUDGET_S / self._step_s)))
        for req in batch.reqs:
            p = req.sampling_params
            if steps == 1 or not p.is_greedy or req.grammar is not None or req.return_logprob \
                    or p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0 \
                    or p.logit_bias or len(req.output_ids) < p.min_new_tokens \
                    or req.total_len != req.computed_len + 1:
                return 1
            steps = min(steps, p.max_new_tokens - len(req.output_ids),
                        self.config.model.context_length - req.total_len)
        return max(steps, 1)

    def _decode_ahead(self, batch: ScheduledBatch, fb: Any, steps: int) -> int:
        """Run `steps` greedy decode steps of `batch` in one call and take their tokens as if
        sampled step by step: a request that finishes stops taking them, and the slots of the
        steps after its end are freed. Returns the steps run (fewer where the pool is short)."""
        reqs, prefix = batch.reqs, batch.prefix_lens
        extra = (steps - 1) * len(reqs)
        self._make_room(extra)
        if self.allocator.available_size() < extra:
            self._process(batch, self.runner.forward(fb))
            return 1
        ahead = self.allocator.alloc_slots(extra).view(len(reqs), steps - 1)  # per request
        for req, p, own in zip(reqs, prefix, ahead):
            self.req_pool.write(req.req_pool_idx, p + 1, own)
        slots = torch.cat([fb.out_cache_loc.view(1, -1), ahead.t()]).contiguous()
        tokens = self.runner.run_ahead(fb, slots).tolist()
        for step_tokens in tokens:
            for req, tok in zip(reqs, step_tokens):
                if not req.finished:
                    req.computed_len += 1
                    self.results.take_greedy(req, tok)
        self.stats["decode_steps"] += steps
        share = self._count_decode_steps(steps)
        for req, p in zip(reqs, prefix):
            if req.computed_len < p + steps:  # finished early: its later slots hold nothing
                row = self.req_pool.req_to_token[req.req_pool_idx]
                self.allocator.free(row[req.computed_len:p + steps])
            self._settle_decoded(req, share)
        return steps

    def _retract_until_fits(self) -> None:
        def need() -> int:
            return sum(self.allocator.pages_needed(r.computed_len, r.total_len)
                       for r in self.running) * self.page_size

        while self.running and need() > (self.allocator.available_size()
                                         + self.cache.evictable_size()):
            victim = max(self.running, key=lambda r: r.arrival_time)
            self.running.remove(victim)
            if not self.running and len(self.waiting) == 0:
                victim.finished_reason = FinishReason.abort(
                    "the KV cache is too small for this request", 503)
                self._finish(victim)
                return
            self._retract(victim)

    def retract(self, req: Req) -> None:
        """Move a running request back to the waiting queue (tests force this)."""
        self.running.remove(req)
        self._retract(req)

    def _retract(self, req: Req) -> None:
        self.cache.cache_finished_req(req)
        self.req_pool.free(req.req_pool_idx)
        req.reset_for_retract()
        self.waiting.add(req, front=True)
        self.stats["retractions"] += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)
        logger.debug("retracted %s", req.rid)

    def _after_decode(self, batch: ScheduledBatch) -> None:
        share = self._count_decode_steps(1)
        jumped = batch.mode is ForwardMode.EXTEND  # forced tokens computed without steps
        for req, ext in zip(batch.reqs, batch.extend_lens):
            req.computed_len += ext
            if jumped:
                req.jump_forward_steps += ext - 1
            self._settle_decoded(req, share)

    def _count_decode_steps(self, steps: int) -> bool:
        """Count `steps` decode steps; whether they reach a multiple of `CACHE_RUNNING_EVERY`
        (running requests then share their KV through the cache)."""
        before = self.decode_steps
        self.decode_steps += steps
        return self.decode_steps // CACHE_RUNNING_EVERY > before // CACHE_RUNNING_EVERY

    def _settle_decoded(self, req: Req, share: bool) -> None:
        """After a decode step (or run): finish `req` if it finished, else report its new
        tokens and, with `share`, make its KV findable in the cache."""
        if req.finished:
            self.running.remove(req)
            self._finish(req)
            return
        self._emit(req)
        if share:
            self.cache.cache_unfinished_req(req)

    # --- finishing ----------------------------------------------------------------------------

    def _release_finished(self) -> None:
        done = [r for r in self.running if r.finished]
        if done:
            self.running = [r for r in self.running if not r.finished]
            for r in done:
                self._finish(r)
        if self.chunked_req is not None and self.chunked_req.finished:
            req, self.chunked_req = self.chunked_req, None
            self._finish(req)

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
            "time": time.time(),
        }

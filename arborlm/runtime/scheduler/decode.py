"""`DecodeScheduler`: the decode set, its steps, retraction, and runs of steps ahead.

The decode set (`running`) holds the requests whose prompt is prefilled. `schedule()` builds one
step of all of them. It first retracts the newest while the pool (free and evictable slots)
cannot hold their next tokens: a retracted request goes back to the front of the waiting queue
with its output kept, and is prefilled again later (mostly from the cache). Tokens a grammar
forced (jump-forward) are in a request's output before their KV is computed: the step computes
them all at once as an extend when there are enough of them (`JUMP_EXTEND_PER_REQUEST`), else
each such request feeds one per decode step. `after_step()` advances the requests once the step
ran: a finished one is finished, the others report their new tokens.

Continuous decode steps (`num_continuous_decode_steps`): when every request of a decode step
`may_run_ahead` and nothing waits, `steps_ahead()` says how many steps may run in one call,
`slots_ahead()` takes their KV slots, and `take_ahead()` takes the tokens as if sampled step by
step.

It also keeps `new_token_ratio`, the share of the running requests' remaining tokens that
admission reserves for them (admission.py): it decays with each decode step and jumps after a
retraction. This module neither runs the forward (the scheduler's step loop does) nor samples
(`results.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from arborlm.runtime.config import EngineConfig
from arborlm.runtime.forward_batch import ForwardMode
from arborlm.runtime.request import FinishReason, Req
from arborlm.runtime.scheduler.batch import ScheduledBatch
from arborlm.runtime.scheduler.kv_slots import KVSlots
from arborlm.runtime.scheduler.policy import WaitingQueue
from arborlm.runtime.scheduler.results import ResultProcessor

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# A retraction shows that admission reserved too little for the running requests' growth: the
# ratio jumps by this much (to at most 1) so that the next admissions leave them more room, and
# decays back by NEW_TOKEN_RATIO_DECAY per decode step (300 steps for the whole jump).
RETRACT_NEW_TOKEN_RATIO_STEP = 0.3
# Running requests make their KV findable by others every this many decode steps.
CACHE_RUNNING_EVERY = 32
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


class DecodeScheduler:
    """`finish` and `emit` are the scheduler's: finish a request (release its KV, report it),
    and report a request's progress."""

    def __init__(self, config: EngineConfig, waiting: WaitingQueue, kv: KVSlots,
                 results: ResultProcessor, stats: dict[str, int], *,
                 finish: Callable[[Req], None], emit: Callable[[Req], None]):
        self.args = config.args
        self.context_length = config.model.context_length
        self.waiting = waiting
        self.kv = kv
        self.cache = kv.cache
        self.req_pool = kv.req_pool
        self.allocator = kv.allocator
        self.results = results
        self.stats = stats
        self.finish = finish
        self.emit = emit
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.decode_steps = 0

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """One step of every running request (None if retraction left none). A request whose
        newest tokens were forced by its grammar has several uncomputed ones: when the batch
        holds enough of those (see `JUMP_EXTEND_PER_REQUEST`), the step is an extend of every
        request's uncomputed tokens; otherwise it is a decode step of each request's oldest
        uncomputed token, and a request that still has more after it is not sampled
        (`ResultProcessor.process`)."""
        self._retract_until_fits()
        if not self.running:
            return None
        reqs = list(self.running)
        pending = [r.total_len - r.computed_len for r in reqs]
        jump = sum(pending) - len(reqs) >= JUMP_EXTEND_PER_REQUEST * len(reqs)
        extend = pending if jump else [1] * len(reqs)
        prefix = [r.computed_len for r in reqs]
        if not jump and self.kv.page_size == 1:  # one new slot each: taken and written at once
            out_cache_loc = self.kv.alloc_one_each(reqs, prefix)
        else:
            slots = [self.kv.alloc(r, r.computed_len, r.computed_len + n)
                     for r, n in zip(reqs, extend)]
            for r, s in zip(reqs, slots):
                self.req_pool.write(r.req_pool_idx, r.computed_len, s)
            out_cache_loc = slots[0] if len(slots) == 1 else torch.cat(slots)
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return ScheduledBatch(
            mode=ForwardMode.EXTEND if jump else ForwardMode.DECODE, decoding=True,
            reqs=reqs, prefix_lens=prefix, extend_lens=extend, sample=[True] * len(reqs),
            input_logprob_positions=[range(0)] * len(reqs), out_cache_loc=out_cache_loc)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance the requests of `batch` (sampled by `ResultProcessor.process`)."""
        self.stats["decode_steps"] += 1
        share = self._count_decode_steps(1)
        jumped = batch.mode is ForwardMode.EXTEND  # forced tokens computed without steps
        for req, ext in zip(batch.reqs, batch.extend_lens):
            req.computed_len += ext
            self.kv.apply_rewind(req)
            if jumped:
                req.jump_forward_steps += ext - 1
            self._settle(req, share)

    def after_verify(self, batch: ScheduledBatch, computed: list[int]) -> None:
        """Advance the requests of a speculative verify step (`batch.draft_ids`): request i
        keeps the KV of its first `computed[i]` new positions (its newest token and the drafts
        it accepted); the slots of the rejected drafts go back to the pool."""
        self.stats["decode_steps"] += 1
        share = self._count_decode_steps(1)
        for req, p, ext, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, computed):
            req.computed_len = p + n
            if n < ext:
                self.allocator.free(self.req_pool.req_to_token[req.req_pool_idx, p + n:p + ext])
            self.kv.apply_rewind(req)  # a guard rollback asked for inside the verified run
            self._settle(req, share)

    def drop_finished(self) -> list[Req]:
        """Remove the finished requests (aborted since the last step) and return them."""
        done = [r for r in self.running if r.finished]
        if done:
            self.running = [r for r in self.running if not r.finished]
        return done

    # --- retraction ---------------------------------------------------------------------------

    def _retract_until_fits(self) -> None:
        def need() -> int:
            return sum(self.allocator.pages_needed(r.computed_len, r.total_len)
                       for r in self.running) * self.kv.page_size

        while self.running and need() > (self.allocator.available_size()
                                         + self.cache.evictable_size()):
            victim = max(self.running, key=lambda r: r.arrival_time)
            self.running.remove(victim)
            if not self.running and len(self.waiting) == 0:
                victim.finished_reason = FinishReason.abort(
                    "the KV cache is too small for this request", 503)
                self.finish(victim)
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
        self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_NEW_TOKEN_RATIO_STEP)
        logger.debug("retracted %s", req.rid)

    # --- continuous decode steps --------------------------------------------------------------

    def steps_ahead(self, batch: ScheduledBatch, *, others_waiting: bool,
                    last_step_s: float) -> int:
        """How many decode steps `batch` may run in one call (`num_continuous_decode_steps`):
        1 unless nothing else waits (`others_waiting`: queued requests or a chunked prompt),
        the page size is 1 and every request `may_run_ahead`; then as many as the option says
        (default: what fits in `AHEAD_BUDGET_S` at `last_step_s` per step, at most
        `AHEAD_MAX_STEPS`), and no more than any request may still produce."""
        if batch.mode is not ForwardMode.DECODE or self.kv.page_size != 1 or others_waiting:
            return 1
        steps = self.args.num_continuous_decode_steps
        if steps is None:
            if last_step_s <= 0:
                return 1
            steps = max(1, min(AHEAD_MAX_STEPS, int(AHEAD_BUDGET_S / last_step_s)))
        for req in batch.reqs:
            if steps == 1 or not req.may_run_ahead:
                return 1
            steps = min(steps, req.sampling_params.max_new_tokens - len(req.output_ids),
                        self.context_length - req.total_len)
        return max(steps, 1)

    def slots_ahead(self, batch: ScheduledBatch, steps: int) -> torch.Tensor | None:
        """KV slots [steps, batch size] for `steps` decode steps of `batch`: the step's own
        (`batch.out_cache_loc`), then one per request for each step after it, written to their
        `req_to_token` rows. None where the pool lacks them (after evicting what it could)."""
        reqs, prefix = batch.reqs, batch.prefix_lens
        extra = (steps - 1) * len(reqs)
        self.kv.make_room(extra)
        if self.allocator.available_size() < extra:
            return None
        ahead = self.allocator.alloc_slots(extra).view(len(reqs), steps - 1)  # per request
        for req, p, own in zip(reqs, prefix, ahead):
            self.req_pool.write(req.req_pool_idx, p + 1, own)
        return torch.cat([batch.out_cache_loc.view(1, -1), ahead.t()]).contiguous()

    def take_ahead(self, batch: ScheduledBatch, tokens: list[list[int]]) -> None:
        """Take the greedy tokens [steps][batch size] of a run of steps over `slots_ahead` as if
        sampled step by step: a request that finishes stops taking them, and the slots of the
        steps after its end are freed."""
        reqs, prefix, steps = batch.reqs, batch.prefix_lens, len(tokens)
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
            self._settle(req, share)

    # --- after a step -------------------------------------------------------------------------

    def _count_decode_steps(self, steps: int) -> bool:
        """Count `steps` decode steps; whether they reach a multiple of `CACHE_RUNNING_EVERY`
        (running requests then share their KV through the cache)."""
        before = self.decode_steps
        self.decode_steps += steps
        return self.decode_steps // CACHE_RUNNING_EVERY > before // CACHE_RUNNING_EVERY

    def _settle(self, req: Req, share: bool) -> None:
        """After a decode step (or run): finish `req` if it finished, else report its new
        tokens and, with `share`, make its KV findable in the cache."""
        if req.finished:
            self.running.remove(req)
            self.finish(req)
            return
        self.emit(req)
        if share:
            self.cache.cache_unfinished_req(req)

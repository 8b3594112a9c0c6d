"""`PrefillScheduler`: the prefill batch of a step, and what its requests do after it.

`schedule()` admits under a `PrefillBudget` (admission.py) the ongoing chunked prompt first,
then waiting requests in the queue's policy order: each is matched against the prefix cache and
its prefix locked; one whose grammar is still compiling is skipped, and one that the in-batch
prefix filter holds back waits a step. An admitted request gets a `req_to_token` row (the first
time) and KV slots for the tokens it prefills. `after_step()`, once the forward and sampling
ran, advances them: an unfinished chunked prompt waits for its next chunk, a finished request is
finished, the others join the decode set.

This module owns the chunked request; it neither runs the forward nor samples, and it never
retracts (`decode.py` does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from arborlm.runtime.config import EngineArgs
from arborlm.runtime.forward_batch import ForwardMode
from arborlm.runtime.request import FinishReason, Req
from arborlm.runtime.scheduler.admission import Admission, PrefillBudget, reserved_tokens
from arborlm.runtime.scheduler.batch import ScheduledBatch
from arborlm.runtime.scheduler.grammar_manager import GrammarManager
from arborlm.runtime.scheduler.in_batch_prefix import InBatchPrefixFilter, NoInBatchFilter
from arborlm.runtime.scheduler.kv_slots import KVSlots
from arborlm.runtime.scheduler.policy import WaitingQueue


class PrefillScheduler:
    """`finish` and `emit` are the scheduler's: finish a request (release its KV, report it),
    and report a request's progress."""

    def __init__(self, args: EngineArgs, waiting: WaitingQueue, kv: KVSlots,
                 grammars: GrammarManager, stats: dict[str, int], *,
                 finish: Callable[[Req], None], emit: Callable[[Req], None]):
        self.args = args
        self.waiting = waiting
        self.kv = kv
        self.cache = kv.cache
        self.req_pool = kv.req_pool
        self.grammars = grammars
        self.stats = stats
        self.finish = finish
        self.emit = emit
        self.in_batch = NoInBatchFilter() if args.disable_radix_cache else InBatchPrefixFilter()
        self.chunked_req: Req | None = None  # a prompt prefilled in chunks, between chunks

    def schedule(self, running: list[Req], new_token_ratio: float) -> ScheduledBatch | None:
        """The prefill batch of this step, its slots taken; None when nobody is admitted.
        `running` (the decode set) and `new_token_ratio` size the tokens it must leave them."""
        if not len(self.waiting) and self.chunked_req is None:
            return None
        budget = self._budget(running, new_token_ratio)
        admitted: list[tuple[Req, int, Admission]] = []  # (request, prefix length, admission)
        slots: list[torch.Tensor] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            adm = budget.try_admit(req, req.computed_len)
            if adm is not None:
                self.chunked_req = None
                slots.append(self._admit(req, req.computed_len, adm))
                admitted.append((req, req.computed_len, adm))
        self.in_batch.start_batch()
        for req in self.waiting.ordered():
            if self.grammars.is_pending(req):
                continue  # its grammar is compiling; the requests behind it go ahead
            evictable = self.cache.evictable_size()
            self._match_and_lock(req)
            if admitted and self.in_batch.should_defer(req):
                self._unlock(req)  # its prefix will be cached after this step
                continue
            # Slots the lock just protected can no longer be evicted for this batch.
            budget.rem_total -= evictable - self.cache.evictable_size()
            adm = budget.try_admit(req, req.cached_len)
            if adm is None:
                self._unlock(req)
                break
            slots.append(self._admit(req, req.cached_len, adm))
            admitted.append((req, req.cached_len, adm))
            self.in_batch.admitted(req)
            self.waiting.remove([req])
        if not admitted:
            return None
        return ScheduledBatch(
            mode=ForwardMode.EXTEND, decoding=False,
            reqs=[req for req, _, _ in admitted],
            prefix_lens=[prefix for _, prefix, _ in admitted],
            extend_lens=[adm.extend_len for _, _, adm in admitted],
            sample=[not adm.chunked and req.sampling_params.max_new_tokens > 0
                    for req, _, adm in admitted],
            input_logprob_positions=[input_logprob_positions(req, prefix, prefix + adm.extend_len)
                                     for req, prefix, adm in admitted],
            out_cache_loc=torch.cat(slots))

    def after_step(self, batch: ScheduledBatch) -> list[Req]:
        """Advance the requests of `batch` past their prefilled tokens; returns those that join
        the decode set (in batch order)."""
        self.stats["prefill_steps"] += 1
        joining = []
        for req, ext in zip(batch.reqs, batch.extend_lens):
            req.computed_len += ext
            self.kv.apply_rewind(req)
            req.check_lengths()
            if req.is_chunked:
                self.cache.cache_unfinished_req(req)
                self.chunked_req = req
                continue
            if req.sampling_params.max_new_tokens == 0 and not req.finished:
                req.finished_reason = FinishReason("length", length=0)
            if req.finished:
                self.finish(req)
            else:
                self.cache.cache_unfinished_req(req)
                joining.append(req)
                self.emit(req)
        return joining

    def drop_finished_chunked(self) -> Req | None:
        """The chunked request if it finished (aborted between chunks), no longer held here."""
        req = self.chunked_req
        if req is None or not req.finished:
            return None
        self.chunked_req = None
        return req

    def _budget(self, running: list[Req], new_token_ratio: float) -> PrefillBudget:
        rem_reqs = min(self.args.max_running_requests - len(running),
                       self.req_pool.available_size())
        chunk = self.args.chunked_prefill_size
        reserved = sum(reserved_tokens(r) for r in running) * new_token_ratio
        return PrefillBudget(
            rem_total=self.kv.allocator.available_size() + self.cache.evictable_size()
            - int(reserved),
            rem_input=self.args.max_prefill_tokens,
            rem_chunk=None if chunk in (None, -1) else chunk,
            rem_reqs=rem_reqs + (1 if self.chunked_req else 0),
            new_token_ratio=new_token_ratio, page_size=self.kv.page_size)

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

    def _admit(self, req: Req, prefix: int, adm: Admission) -> torch.Tensor:
        """Give `req` a row (the first time) and KV slots for its extend range; returns them."""
        if req.req_pool_idx is None:
            req.req_pool_idx = self.req_pool.alloc()
            assert req.req_pool_idx is not None, "budget admitted more requests than rows"
            self.req_pool.write(req.req_pool_idx, 0, req.prefix_slots)
            if req.retractions == 0:
                req.cached_tokens = req.cached_len
                self.stats["cached_tokens"] += req.cached_len
        slots = self.kv.alloc(req, prefix, prefix + adm.extend_len)
        self.req_pool.write(req.req_pool_idx, prefix, slots)
        req.is_chunked = adm.chunked
        self.stats["prefill_tokens"] += adm.extend_len
        return slots


def input_logprob_positions(req: Req, prefix: int, end: int) -> range:
    """Positions in [prefix, end) whose logits give `req` the input logprob of the next token."""
    if not req.wants_input_logprobs or req.input_logprobs_done:
        return range(0)
    first = max(req.logprob_start_len - 1, 0)
    last = min(end, req.prompt_len - 1)  # logits at p give the logprob of token p+1
    return range(max(first, prefix), max(last, max(first, prefix)))

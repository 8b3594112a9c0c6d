"""`KVSlots`: KV pool slots for the new positions of scheduled requests.

Prefill and decode scheduling take slots through it; when the pool is short it first evicts
cached prefixes (as far as the prefix cache allows). It does not decide who gets slots (that is
admission's and retraction's), and it frees them only to rewind a request (`rewind`: drop its
newest output tokens between steps; the prefix cache and the allocator free the rest).
"""

from __future__ import annotations

import torch

from arborlm.radix_cache import PrefixCache
from arborlm.runtime.memory_pool import PagedAllocator, ReqToTokenPool
from arborlm.runtime.request import Req


class KVSlots:
    def __init__(self, req_pool: ReqToTokenPool, allocator: PagedAllocator, cache: PrefixCache,
                 page_size: int):
        self.req_pool = req_pool
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size

    def make_room(self, slots: int) -> None:
        """Evict cached prefixes until `slots` slots are free (as far as the cache allows)."""
        if self.allocator.available_size() < slots:
            self.cache.evict(slots - self.allocator.available_size())

    def alloc(self, req: Req, start: int, end: int) -> torch.Tensor:
        """Slots for positions [start, end) of `req`, continuing its last page where it is
        partly filled (the caller writes them to its `req_to_token` row)."""
        self.make_room(self.allocator.pages_needed(start, end) * self.page_size)
        last = 0  # the slot of position start - 1, read only where a page continues
        if start % self.page_size:
            last = int(self.req_pool.req_to_token[req.req_pool_idx, start - 1])
        return self.allocator.alloc_range(start, end, last)

    def alloc_one_each(self, reqs: list[Req], positions: list[int]) -> torch.Tensor:
        """A slot for position `positions[i]` of each request `reqs[i]` (page size 1), written
        to their `req_to_token` rows: a decode step's, in one call each rather than per
        request."""
        self.make_room(len(reqs))
        slots = self.allocator.alloc_slots(len(reqs))
        self.req_pool.write_one_each([r.req_pool_idx for r in reqs], positions, slots)
        return slots

    def rewind(self, req: Req, n: int) -> None:
        """Drop the newest `n` output tokens of `req` between steps (`Req.drop_output`) and the
        KV behind them, so that decoding resumes as if they had never been sampled.

        The newest kept token loses its KV too (the next step computes it again: its logits are
        needed). Slots the request owns past the kept positions go back to the pool (with a page
        size above 1 the page holding the last kept position stays). Where the kept positions
        end inside the prefix the request has locked in the cache, it locks the shorter prefix
        instead (page-aligned; the tokens past it are computed again) and the cache keeps the
        rest, unlocked."""
        req.drop_output(n)
        old, cached = req.computed_len, req.cached_len
        new = min(old, req.total_len - 1)
        if new >= old:
            return  # the dropped tokens had no KV yet (forced tokens)
        p = self.page_size
        if new < cached:
            new -= new % p
            match = self.cache.match_prefix(req.fill_ids[:new], req.extra_key)
            assert len(match.slots) == new, f"{req}: its locked prefix is no longer cached"
            self.cache.lock(match.node)
            if req.last_node is not None:
                self.cache.unlock(req.last_node)
            req.last_node, req.prefix_slots, req.cached_len = match.node, match.slots, new
        first = max(-(-new // p) * p, cached)  # its own slots from the next page boundary on
        if first < old:
            self.allocator.free(self.req_pool.req_to_token[req.req_pool_idx, first:old])
        req.computed_len = new
        req.check_lengths()

    def apply_rewind(self, req: Req) -> None:
        """After a step: rewind `req` to the output length its sampling asked for (a semantic
        guard's rollback, `req.rewind_to`), if any."""
        if req.rewind_to is not None:
            n, req.rewind_to = len(req.output_ids) - req.rewind_to, None
            if n > 0 and not req.finished:
                self.rewind(req, n)

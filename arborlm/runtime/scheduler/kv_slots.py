"""`KVSlots`: KV pool slots for the new positions of scheduled requests.

Prefill and decode scheduling take slots through it; when the pool is short it first evicts
cached prefixes (as far as the prefix cache allows). It does not decide who gets slots (that is
admission's and retraction's), and it does not free them (the prefix cache and the allocator do).
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

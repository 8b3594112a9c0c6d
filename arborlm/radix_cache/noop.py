"""`NoOpCache`: the prefix cache that caches nothing (`--disable-radix-cache`).

It has `RadixCache`'s interface so that the scheduler needs no `if cache_enabled:` branch:
matches are always empty, a finished request's KV goes straight back to the allocator, and
nothing is ever evictable. It never holds a slot, so free slots + slots of live requests ==
all usable slots at all times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from arborlm.radix_cache.base import MatchResult, PrefixCache, TreeNode

if TYPE_CHECKING:
    from arborlm.runtime.memory_pool import PagedAllocator, ReqToTokenPool
    from arborlm.runtime.request import Req


class NoOpCache(PrefixCache):
    """Caches nothing; every method keeps `PrefixCache`'s contract with an empty cache."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator,
                 page_size: int):
        super().__init__(req_to_token_pool, allocator, page_size)
        # the node every match ends at: a childless root, so lock/unlock have nothing to do
        self.root = TreeNode([], self._empty(), None, 0, 0)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(self._empty(), self.root)

    def insert(self, token_ids: list[int], slots: torch.Tensor,
               extra_key: str | None = None) -> int:
        """Take ownership of `slots` as the contract says, and drop them at once: n_dup = 0."""
        assert len(token_ids) == len(slots), f"{len(token_ids)} tokens but {len(slots)} slots"
        assert len(slots) % self.page_size == 0, f"unaligned insert of {len(slots)} tokens"
        self.allocator.free(slots)
        return 0

    def lock(self, node: Any) -> None:
        return None

    def unlock(self, node: Any) -> None:
        return None

    def evict(self, n_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def check_integrity(self) -> None:
        assert not self.root.children and self.root.lock_ref == 0, "the no-op cache holds nodes"

    def reset(self) -> None:
        return None

    def cache_finished_req(self, req: Req) -> None:
        """Free all of the request's KV, `row[:computed_len]` (each page once)."""
        assert req.cached_len == 0, f"{req} has a cached prefix under the no-op cache"
        row = req.req_pool_idx
        assert row is not None, f"{req} has no req_to_token row"
        # [computed_len]; with page size > 1 the allocator frees each page once
        self.allocator.free(self.req_to_token_pool.req_to_token[row, :req.computed_len])
        req.last_node = None

    def cache_unfinished_req(self, req: Req) -> None:
        return None

"""Prefix cache behind a small interface: a radix tree over token ids, and a no-op cache.

`create_prefix_cache` picks the implementation; the scheduler sees only `PrefixCache`.
Importing this package loads torch and nothing heavier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arborlm.radix_cache.base import MatchResult, PrefixCache, TreeNode
from arborlm.radix_cache.noop import NoOpCache
from arborlm.radix_cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from arborlm.runtime.memory_pool import PagedAllocator, ReqToTokenPool

__all__ = ["MatchResult", "NoOpCache", "PrefixCache", "RadixCache", "TreeNode",
           "create_prefix_cache"]


def create_prefix_cache(disable: bool, req_to_token_pool: ReqToTokenPool,
                        allocator: PagedAllocator, page_size: int) -> PrefixCache:
    """A `NoOpCache` when `disable`, else a `RadixCache`."""
    cls = NoOpCache if disable else RadixCache
    return cls(req_to_token_pool, allocator, page_size)

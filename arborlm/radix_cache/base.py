"""The prefix-cache interface: `PrefixCache`, its `MatchResult`, and the tree node type.

The scheduler talks to a prefix cache only through `PrefixCache`; `RadixCache` implements it
with a radix tree and `NoOpCache` with nothing, so the scheduler has no `if cache_enabled:`
branches. This module holds no algorithm; it states the contracts.

Ownership of KV slots, the heart of the contract:

- A slot is in exactly one of three places: the allocator's free list, the cache (a tree node's
  `value`), or a request's own tail (`req_to_token[row, cached_len:computed_len]`).
- `insert` transfers ownership of the slots it stores to the cache; slots of tokens that were
  already cached stay with the caller (the returned `n_dup` says how many).
- A request that matched a prefix holds a lock on the node where the match ends; locked nodes
  (and all their ancestors) are never evicted, so the request may keep reading those slots.
- Invariant: free slots + cached slots + slots owned by live requests == all usable slots; when
  no request is live, free + cached == total.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from arborlm.runtime.memory_pool import PagedAllocator, ReqToTokenPool
    from arborlm.runtime.request import Req


class TreeNode:
    """One edge of the radix tree: a run of tokens and the KV slots that hold them.

    `key` holds token ids, `value` the int64 slots `[len(key)]`; with page size P both have a
    length that is a multiple of P and `value` is made of whole pages. `children` maps a child's
    first token (P == 1) or the tuple of its first page's tokens (P > 1) to the child.
    `lock_ref` counts the locks taken on this node or any descendant. `last_access_time` is a
    logical clock (larger = used more recently). A root has `parent is None`, an empty key, and
    the namespace (`extra_key`) it roots.
    """

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id",
                 "extra_key")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None,
                 last_access_time: int, node_id: int, extra_key: str | None = None):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # [len(key)] int64 KV slots
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.id = node_id
        self.extra_key = extra_key

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)}, t={self.last_access_time})")


@dataclass
class MatchResult:
    """The longest cached prefix of a key.

    `slots` are the int64 KV slots `[n]` of that prefix (n a multiple of the page size); `node`
    is the tree node where the match ends (a root when nothing matched): pass it to `lock` /
    `unlock`, or walk `node.parent` to the root.
    """

    slots: torch.Tensor  # [n] int64
    node: Any


class PrefixCache(abc.ABC):
    """A cache of KV slots keyed by token-id prefixes, within namespaces (`extra_key`).

    Requests share prefixes only within the same `extra_key`; `None` is a namespace of its own.
    Every length the cache stores or returns is a multiple of `page_size`.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator,
                 page_size: int):
        assert page_size >= 1 and allocator.page_size == page_size, (
            f"page_size {page_size} != allocator page size {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.device = req_to_token_pool.req_to_token.device

    @abc.abstractmethod
    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        """The longest cached prefix of `token_ids`, truncated to a multiple of `page_size`.

        Refreshes the access time of every node on the matched path. When the match ends
        inside a node, the node is split there so that the returned node ends exactly at the
        match. Does not lock: lock the node before anything that may evict.
        """

    @abc.abstractmethod
    def insert(self, token_ids: list[int], slots: torch.Tensor,
               extra_key: str | None = None) -> int:
        """Cache `token_ids` with their KV `slots` `[len(token_ids)]`; return `n_dup`.

        Both have the same page-aligned length (the caller truncates). The cache takes
        ownership of `slots[n_dup:]`; `n_dup` is the number of leading tokens that were
        already cached, so the caller still owns `slots[:n_dup]` and must free the part of them
        it does not hold through a lock. Refreshes access times along the path.
        """

    @abc.abstractmethod
    def lock(self, node: Any) -> None:
        """Protect `node` and its ancestors from eviction (counts nest)."""

    @abc.abstractmethod
    def unlock(self, node: Any) -> None:
        """Undo one `lock(node)`; nodes whose count reaches 0 become evictable again."""

    @abc.abstractmethod
    def evict(self, n_tokens: int) -> int:
        """Free at least `n_tokens` slots if that many are evictable; return the slots freed.

        Evicts unlocked leaves, least recently used first (a parent becomes a candidate once
        its last child is gone), and returns their slots to the allocator. When it frees fewer
        than `n_tokens`, nothing evictable is left.
        """

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Tokens cached in unlocked nodes."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Tokens cached in locked nodes."""

    def total_size(self) -> int:
        """All cached tokens: `evictable_size() + protected_size()`."""
        return self.evictable_size() + self.protected_size()

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise `AssertionError` describing the first broken invariant, if any.

        Checks: sizes agree with the tree; lock counts agree (a node's count is at least the
        sum of its children's); no slot is in two nodes or in the allocator's free set;
        lengths are page-aligned.
        """

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every cached prefix and free its slots. Only valid when nothing is locked."""

    @abc.abstractmethod
    def cache_finished_req(self, req: Req) -> None:
        """A request finished, was aborted or retracted: cache its KV and release its lock.

        Caches the page-aligned part of `fill_ids[:computed_len]`, frees the request's
        unaligned tail and the slots it computed for tokens the cache already had, unlocks
        `req.last_node` and sets it to None. Slots `row[:cached_len]` belong to the cache.
        Does not free the request's `req_to_token` row (the scheduler does).
        """

    @abc.abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """A running (or chunked) request grew: make its page-aligned KV findable by others.

        Caches like `cache_finished_req`, then points `req_to_token[row, :L]` at the cached
        slots, moves the request's lock to the new last node, and sets `req.cached_len`,
        `req.prefix_slots` and `req.last_node` accordingly. The unaligned tail stays with the
        request.
        """

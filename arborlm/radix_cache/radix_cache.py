"""`RadixCache`: a radix tree of token ids whose edges hold KV slots, one tree per namespace.

Algorithm notes:

- Each namespace (`extra_key`) has its own root; a non-default root exists only while it has
  children. A node's children are keyed by the child's first token (page size 1) or by the
  tuple of its first page's tokens (page size P > 1); every stored length is a multiple of P.
- `match_prefix` / `insert` descend from the root comparing whole runs of tokens (list slices
  compared in C, a short Python loop only around the first mismatch). When a match ends inside
  a node, the node is split there (at a page boundary), so a returned node always ends exactly
  at the match and a node is always touched as a whole: all tokens of a node share one access
  time, taken from a logical clock.
- `lock_ref` of a node counts the locks taken on it or any descendant (a lock walks up to the
  root), so an unlocked node has no locked descendant and an unlocked leaf may be evicted.
- Eviction pops a min-heap of (access time, node id) over unlocked leaves. Entries are pushed
  when a node becomes an unlocked leaf or is touched while one, and are never removed: a popped
  entry is used only if its node is still an attached, unlocked leaf with the same access time
  (lazy deletion). The heap is rebuilt when stale entries outnumber the nodes, so `evict` costs
  O(k log n) for k evicted nodes, amortized.

This module does not decide when to evict or whom to admit; the scheduler does.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any

import torch

from arborlm.radix_cache.base import MatchResult, PrefixCache, TreeNode

if TYPE_CHECKING:
    from arborlm.runtime.memory_pool import PagedAllocator, ReqToTokenPool
    from arborlm.runtime.request import Req

_BLOCK = 64  # tokens compared per slice while locating a mismatch


def common_prefix_len(node_key: list[int], key: list[int], start: int) -> int:
    """Length of the common prefix of `node_key` and `key[start:]`."""
    n = min(len(node_key), len(key) - start)
    if key[start:start + n] == (node_key if n == len(node_key) else node_key[:n]):
        return n
    i = 0
    while i + _BLOCK <= n and key[start + i:start + i + _BLOCK] == node_key[i:i + _BLOCK]:
        i += _BLOCK
    while i < n and key[start + i] == node_key[i]:
        i += 1
    return i


class RadixCache(PrefixCache):
    """The radix-tree prefix cache; see the module docstring for the algorithm."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator,
                 page_size: int):
        super().__init__(req_to_token_pool, allocator, page_size)
        self._clock = itertools.count(1)
        self._ids = itertools.count(0)
        self._heap_seq = itertools.count()
        self._clear()

    def _clear(self) -> None:
        self.root = self._new_root(None)
        self._roots: dict[str | None, TreeNode] = {None: self.root}
        # entries (last_access_time, node id, push sequence, node); see module docstring
        self._heap: list[tuple[int, int, int, TreeNode]] = []
        self._num_nodes = 0  # non-root nodes
        self._evictable = 0
        self._protected = 0

    # --- namespaces ----------------------------------------------------------------------

    def _new_root(self, extra_key: str | None) -> TreeNode:
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return TreeNode([], empty, None, next(self._clock), next(self._ids), extra_key)

    def root_for(self, extra_key: str | None) -> TreeNode | None:
        """The root of namespace `extra_key`, or None when nothing is cached under it."""
        return self._roots.get(extra_key)

    def roots(self) -> dict[str | None, TreeNode]:
        """Every namespace's root, by `extra_key` (a copy; the default root is always there)."""
        return dict(self._roots)

    # --- match / insert ------------------------------------------------------------------

    def _child_key(self, key: list[int], i: int) -> Any:
        return key[i] if self.page_size == 1 else tuple(key[i:i + self.page_size])

    def _aligned(self, token_ids: list[int]) -> list[int]:
        n = len(token_ids)
        return list(token_ids[:n - n % self.page_size])

    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        key = self._aligned(token_ids)
        root = self._roots.get(extra_key)
        if root is None:
            # a detached empty root: lock/unlock on it are no-ops, as on any root
            return MatchResult(torch.empty(0, dtype=torch.int64, device=self.device),
                               self._new_root(extra_key))
        node, _, values = self._descend(root, key)
        if not values:
            slots = torch.empty(0, dtype=torch.int64, device=self.device)
        else:
            slots = values[0].clone() if len(values) == 1 else torch.cat(values)  # [n]
        return MatchResult(slots, node)

    def insert(self, token_ids: list[int], slots: torch.Tensor,
               extra_key: str | None = None) -> int:
        key = list(token_ids)
        assert len(key) == len(slots), f"{len(key)} tokens but {len(slots)} slots"
        assert len(key) % self.page_size == 0, f"unaligned insert of {len(key)} tokens"
        if not key:
            return 0
        root = self._roots.get(extra_key)
        if root is None:
            root = self._roots[extra_key] = self._new_root(extra_key)
        node, n_dup, _ = self._descend(root, key)
        if n_dup < len(key):
            leaf = TreeNode(key[n_dup:], slots[n_dup:].clone(), node,
                            node.last_access_time, next(self._ids))
            node.children[self._child_key(key, n_dup)] = leaf
            self._num_nodes += 1
            self._evictable += len(leaf.key)
            self._push(leaf)
        return n_dup

    def _descend(self, root: TreeNode, key: list[int]) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `key` down from `root` as far as it is cached; touch the path.

        Splits the node where the match ends inside it. Returns the last matched node, the
        matched length and the matched nodes' slot tensors in order.
        """
        now = next(self._clock)
        root.last_access_time = now
        node, i, values = root, 0, []
        while i < len(key):
            child = node.children.get(self._child_key(key, i))
            if child is None:
                break
            n = common_prefix_len(child.key, key, i)
            n -= n % self.page_size  # >= page_size: the first token / page matched
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node, i = child, i + n
        if node.parent is not None and not node.children and node.lock_ref == 0:
            self._push(node)
        return node, i, values

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first `n` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key) and n % self.page_size == 0
        mid = TreeNode(child.key[:n], child.value[:n], parent, child.last_access_time,
                       next(self._ids))
        mid.lock_ref = child.lock_ref
        parent.children[self._child_key(mid.key, 0)] = mid
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = mid
        mid.children[self._child_key(child.key, 0)] = child
        self._num_nodes += 1
        return mid

    # --- locks ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, f"unlock of unlocked {node}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                if not node.children:
                    self._push(node)
            node = node.parent

    # --- eviction ------------------------------------------------------------------------

    def _push(self, node: TreeNode) -> None:
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()
        heapq.heappush(self._heap,
                       (node.last_access_time, node.id, next(self._heap_seq), node))

    def _rebuild_heap(self) -> None:
        self._heap = [(n.last_access_time, n.id, next(self._heap_seq), n)
                      for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(self._heap)

    @staticmethod
    def _entry_live(node: TreeNode, time: int) -> bool:
        return (node.parent is not None and not node.children and node.lock_ref == 0
                and node.last_access_time == time)

    def evict(self, n_tokens: int) -> int:
        freed = 0
        victims: list[torch.Tensor] = []
        while freed < n_tokens and self._heap:
            time, _, _, node = heapq.heappop(self._heap)
            if not self._entry_live(node, time):
                continue
            victims.append(node.value)
            freed += len(node.key)
            self._remove_leaf(node)
        if victims:
            self.allocator.free(torch.cat(victims))
        return freed

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key, 0)]
        node.parent = None
        self._num_nodes -= 1
        self._evictable -= len(node.key)
        if parent.children:
            return
        if parent.parent is None:
            if parent is not self.root:
                del self._roots[parent.extra_key]
        elif parent.lock_ref == 0:
            self._push(parent)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def reset(self) -> None:
        assert self._protected == 0, f"reset with {self._protected} locked tokens"
        values = [n.value for n in self._nodes()]
        if values:
            self.allocator.free(torch.cat(values))
        self._clear()

    # --- integrity -----------------------------------------------------------------------

    def _nodes(self) -> list[TreeNode]:
        """Every non-root node, parents before children."""
        out: list[TreeNode] = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                out.append(node)
                stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        for extra_key, root in self._roots.items():
            assert root.parent is None and not root.key and root.lock_ref == 0, f"bad root {root}"
            assert root.extra_key == extra_key, f"root of {extra_key!r} says {root.extra_key!r}"
            assert root is self.root or root.children, f"empty namespace {extra_key!r} kept"
        nodes = self._nodes()
        assert len(nodes) == self._num_nodes, f"{len(nodes)} nodes, counted {self._num_nodes}"
        evictable = protected = 0
        for node in nodes:
            self._check_node(node)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self._evictable, f"evictable {self._evictable} != tree {evictable}"
        assert protected == self._protected, f"protected {self._protected} != tree {protected}"
        self._check_slots([n.value for n in nodes])
        live = {id(n) for t, _, _, n in self._heap if self._entry_live(n, t)}
        for node in nodes:
            if not node.children and node.lock_ref == 0:
                assert id(node) in live, f"evictable leaf {node} missing from the eviction heap"

    def _check_node(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None, f"{node} reachable but detached"
        assert parent.children.get(self._child_key(node.key, 0)) is node, f"{node} misfiled"
        assert len(node.key) == len(node.value) > 0, f"{node}: key/value lengths differ"
        assert len(node.key) % self.page_size == 0, f"{node}: unaligned length"
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), (
            f"{node}: lock_ref below its children's sum")
        assert node.last_access_time <= parent.last_access_time, f"{node} newer than parent"

    def _check_slots(self, values: list[torch.Tensor]) -> None:
        if not values:
            return
        p = self.page_size
        slots = torch.cat(values).cpu()  # [total]
        assert slots.unique().numel() == slots.numel(), "a KV slot is cached in two nodes"
        if p > 1:
            pages = slots.view(-1, p)  # [total / p, p]: each row must be one whole page
            whole = (pages[:, 0] % p == 0) & (pages - pages[:, :1] == torch.arange(p)).all(1)
            assert bool(whole.all()), "a node holds a partial or scrambled page"
        page_ids = set((slots // p).tolist())
        assert 0 not in page_ids, "the padding page is cached"
        freed = page_ids & self.allocator.free_page_set()
        assert not freed, f"cached pages are on the free list: {sorted(freed)[:8]}"

    # --- request-level -------------------------------------------------------------------

    def _insert_req(self, req: Req) -> int:
        """Insert the page-aligned part of the request's KV; free its duplicates; return L."""
        row, n = req.req_pool_idx, req.computed_len
        assert row is not None, f"{req} has no req_to_token row"
        aligned = n - n % self.page_size
        slots = self.req_to_token_pool.req_to_token[row, :aligned]  # [aligned]
        n_dup = self.insert(req.fill_ids[:aligned], slots, req.extra_key)
        assert n_dup >= req.cached_len, f"{req}: its locked prefix is no longer cached"
        if n_dup > req.cached_len:
            self.allocator.free(slots[req.cached_len:n_dup])
        return aligned

    def cache_finished_req(self, req: Req) -> None:
        aligned = self._insert_req(req)
        if aligned < req.computed_len:
            tail = self.req_to_token_pool.req_to_token[req.req_pool_idx, aligned:req.computed_len]
            self.allocator.free(tail)  # [computed_len - aligned]: a partial page of its own
        if req.last_node is not None:
            self.unlock(req.last_node)
        req.last_node = None

    def cache_unfinished_req(self, req: Req) -> None:
        aligned = self._insert_req(req)
        match = self.match_prefix(req.fill_ids[:aligned], req.extra_key)
        assert len(match.slots) == aligned, f"{req}: re-match found {len(match.slots)}"
        self.req_to_token_pool.write(req.req_pool_idx, 0, match.slots)
        self.lock(match.node)
        if req.last_node is not None:
            self.unlock(req.last_node)
        req.last_node = match.node
        req.cached_len = aligned
        req.prefix_slots = match.slots

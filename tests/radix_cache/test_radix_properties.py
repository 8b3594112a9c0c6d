"""Property tests: random insert / match / lock / unlock / evict / request sequences.

A hypothesis state machine drives a prefix cache (with the real allocator and req_to_token
pool) and a reference model: a dict from (extra_key, page-aligned prefix) to the slots of that
prefix's last page. After every step it checks that the tree holds exactly the model's
prefixes with the model's slots, that every slot is free, cached or owned by one live request
(none leaked, none twice), that locked prefixes are still cached and counted as protected, and
`check_integrity()`. Matches must return the model's longest cached prefix; an eviction must
free whole unlocked subtrees, least recently used leaves first.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from arborlm.radix_cache import NoOpCache, PrefixCache, create_prefix_cache
from arborlm.runtime.memory_pool import PagedAllocator, ReqToTokenPool
from arborlm.runtime.request import Req
from arborlm.runtime.sampling_params import SamplingParams

Prefix = tuple[str | None, tuple[int, ...]]

# (which earlier key to share a prefix with, how much of it to keep, a random suffix)
KEYS = st.tuples(st.integers(0, 63), st.integers(0, 32), st.lists(st.integers(0, 7), max_size=32))
NAMESPACES = st.sampled_from([None, None, "a"])
MAX_REQS = 4


def tree_contents(cache: PrefixCache) -> dict[Prefix, torch.Tensor]:
    """Every cached page-aligned prefix and the slots of its last page, read off the tree."""
    if isinstance(cache, NoOpCache):
        assert not cache.root.children
        return {}
    p, out = cache.page_size, {}
    for extra_key, root in cache.roots().items():
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                full = prefix + tuple(child.key)
                for j in range(0, len(child.key), p):
                    out[(extra_key, full[: len(prefix) + j + p])] = child.value[j:j + p]
                stack.append((child, full))
    return out


def tree_nodes(cache: PrefixCache) -> list:
    if isinstance(cache, NoOpCache):
        return []
    nodes, stack = [], [r for r in cache.roots().values()]
    while stack:
        node = stack.pop()
        nodes.extend(node.children.values())
        stack.extend(node.children.values())
    return nodes


def path_tokens(node) -> list[int]:
    tokens: list[int] = []
    while node.parent is not None:
        tokens[:0] = node.key
        node = node.parent
    return tokens


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    disable = False
    alphabet = 3
    max_len = 12
    num_pages = 41

    def __init__(self):
        super().__init__()
        p = self.page_size
        self.pool = ReqToTokenPool(MAX_REQS, self.max_len)
        self.alloc = PagedAllocator(self.num_pages * p, p)
        self.cache = create_prefix_cache(self.disable, self.pool, self.alloc, p)
        self.model: dict[Prefix, torch.Tensor] = {}
        self.locks: list[tuple[object, str | None, tuple[int, ...]]] = []
        self.reqs: list[Req] = []
        self.seen: list[list[int]] = [[]]
        self.n_reqs = 0

    # --- the reference model -----------------------------------------------------------

    def make_key(self, spec: tuple[int, int, list[int]]) -> list[int]:
        which, keep, suffix = spec
        base = self.seen[which % len(self.seen)]
        key = (base[:keep] + [t % self.alphabet for t in suffix])[: self.max_len]
        if len(self.seen) < 64:
            self.seen.append(key)
        return key

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def longest(self, ns: str | None, key: list[int]) -> int:
        k, p = 0, self.page_size
        while k + p <= len(key) and (ns, tuple(key[: k + p])) in self.model:
            k += p
        return k

    def model_slots(self, ns: str | None, key: list[int], k: int) -> torch.Tensor:
        pages = [self.model[(ns, tuple(key[: j + self.page_size]))]
                 for j in range(0, k, self.page_size)]
        return torch.cat(pages) if pages else torch.empty(0, dtype=torch.int64)

    def model_insert(self, ns: str | None, key: list[int], slots: torch.Tensor) -> None:
        if self.disable:
            return
        for j in range(0, self.aligned(len(key)), self.page_size):
            self.model.setdefault((ns, tuple(key[: j + self.page_size])),
                                  slots[j:j + self.page_size].clone())

    def locked_prefixes(self) -> set[Prefix]:
        held = [(ns, prefix) for _, ns, prefix in self.locks]
        held += [(r.extra_key, tuple(r.fill_ids[: r.cached_len])) for r in self.reqs]
        return {(ns, prefix[:j]) for ns, prefix in held
                for j in range(self.page_size, len(prefix) + 1, self.page_size)}

    def checked_match(self, key: list[int], ns: str | None):
        expected = self.longest(ns, key)
        match = self.cache.match_prefix(key, ns)
        assert len(match.slots) == expected, (len(match.slots), expected)
        assert torch.equal(match.slots, self.model_slots(ns, key, expected))
        assert path_tokens(match.node) == key[:expected]
        return match

    def owned_pages(self, req: Req) -> set[int]:
        row = self.pool.req_to_token[req.req_pool_idx, req.cached_len:req.computed_len]
        return set((row // self.page_size).tolist())

    # --- eviction, checked --------------------------------------------------------------

    def evict_checked(self, n: int) -> None:
        before, free_before = dict(self.model), self.alloc.available_size()
        nodes = [(node, node.last_access_time, not node.children and not node.lock_ref)
                 for node in tree_nodes(self.cache)]
        freed = self.cache.evict(n)
        after = tree_contents(self.cache)
        removed = before.keys() - after.keys()
        assert after.keys() <= before.keys()
        assert all(torch.equal(after[k], before[k]) for k in after)
        assert freed == self.page_size * len(removed)
        assert self.alloc.available_size() == free_before + freed
        assert freed >= n or self.cache.evictable_size() == 0
        assert not removed & self.locked_prefixes(), "a locked prefix was evicted"
        for ns, prefix in removed:  # whole subtrees go: a removed prefix has no cached extension
            assert not any(a == ns and b[: len(prefix)] == prefix for a, b in after)
        gone = [t for node, t, _ in nodes if node.parent is None]
        kept_leaves = [t for node, t, leaf in nodes if leaf and node.parent is not None]
        if gone and kept_leaves:
            assert max(gone) <= min(kept_leaves), "evicted a leaf newer than a surviving one"
        self.model = after

    def make_room(self, n_slots: int) -> bool:
        short = n_slots - self.alloc.available_size()
        if short > 0:
            self.evict_checked(short)
        return self.alloc.available_size() >= n_slots

    # --- raw tree operations ------------------------------------------------------------

    @rule(spec=KEYS, ns=NAMESPACES)
    def insert(self, spec, ns):
        key = self.make_key(spec)
        key = key[: self.aligned(len(key))]
        if not key or not self.make_room(len(key)):
            return
        slots = self.alloc.alloc_range(0, len(key), 0)
        expected = 0 if self.disable else self.longest(ns, key)
        n_dup = self.cache.insert(key, slots, ns)
        assert n_dup == expected, (n_dup, expected)
        self.alloc.free(slots[:n_dup])
        self.model_insert(ns, key, slots)

    @rule(spec=KEYS, ns=NAMESPACES)
    def match(self, spec, ns):
        self.checked_match(self.make_key(spec), ns)

    @rule(spec=KEYS, ns=NAMESPACES)
    def lock(self, spec, ns):
        key = self.make_key(spec)
        match = self.checked_match(key, ns)
        self.cache.lock(match.node)
        self.locks.append((match.node, ns, tuple(key[: len(match.slots)])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 63))
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 40))
    def evict(self, n):
        self.evict_checked(n)

    # --- request-level operations, as the scheduler uses them ---------------------------

    @precondition(lambda self: len(self.reqs) < MAX_REQS)
    @rule(spec=KEYS, ns=NAMESPACES)
    def admit(self, spec, ns):
        key = self.make_key(spec)
        if not key:
            return
        self.n_reqs += 1
        req = Req(f"r{self.n_reqs}", key, SamplingParams(), extra_key=ns)
        match = self.checked_match(key, ns)
        self.cache.lock(match.node)
        req.req_pool_idx = self.pool.alloc()
        self.pool.write(req.req_pool_idx, 0, match.slots)
        req.cached_len = req.computed_len = len(match.slots)
        req.prefix_slots, req.last_node = match.slots, match.node
        self.reqs.append(req)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 63), n=st.integers(1, 12))
    def compute(self, i, n):
        req = self.reqs[i % len(self.reqs)]
        start, end = req.computed_len, min(req.total_len, req.computed_len + n)
        if not self.make_room(self.alloc.pages_needed(start, end) * self.page_size):
            return
        row = self.pool.req_to_token[req.req_pool_idx]
        last = int(row[start - 1]) if start else 0
        self.pool.write(req.req_pool_idx, start, self.alloc.alloc_range(start, end, last))
        req.computed_len = end

    def cache_req(self, i: int, finished: bool) -> None:
        req = self.reqs[i % len(self.reqs)]
        ns, n, p = req.extra_key, req.computed_len, self.page_size
        key = req.fill_ids[: self.aligned(n)]
        row = self.pool.req_to_token[req.req_pool_idx, :n].clone()
        free_before, cached_before = self.alloc.available_size(), req.cached_len
        if self.disable:
            freed = p * len(set((row // p).tolist())) if finished else 0
        else:
            freed = max(0, self.longest(ns, key) - cached_before) + (p if finished and n % p else 0)
        if finished:
            self.cache.cache_finished_req(req)
            assert req.last_node is None
            self.pool.free(req.req_pool_idx)
            self.reqs.remove(req)
        else:
            self.cache.cache_unfinished_req(req)
        assert self.alloc.available_size() == free_before + freed
        self.model_insert(ns, key, row)
        if not finished and not self.disable:
            assert req.cached_len == len(key)
            cached = self.model_slots(ns, key, len(key))
            assert torch.equal(self.pool.req_to_token[req.req_pool_idx, :len(key)], cached)
            assert torch.equal(req.prefix_slots, cached)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 63))
    def cache_unfinished(self, i):
        self.cache_req(i, finished=False)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 63))
    def finish(self, i):
        self.cache_req(i, finished=True)

    # --- invariants after every step ----------------------------------------------------

    @invariant()
    def tree_matches_model(self):
        self.cache.check_integrity()
        contents = tree_contents(self.cache)
        assert contents.keys() == self.model.keys()
        assert all(torch.equal(contents[k], self.model[k]) for k in contents)

    @invariant()
    def every_slot_accounted_once(self):
        p, free = self.page_size, self.alloc.free_page_set()
        cached = {int(s) // p for v in self.model.values() for s in v}
        owned: set[int] = set()
        for req in self.reqs:
            mine = self.owned_pages(req)
            assert not mine & owned, "two requests own one page"
            owned |= mine
            prefix = self.model_slots(req.extra_key, req.fill_ids, req.cached_len)
            assert torch.equal(self.pool.req_to_token[req.req_pool_idx, :req.cached_len], prefix)
        assert not (cached & free or owned & free or cached & owned), "a page in two places"
        assert len(free) + len(cached) + len(owned) == self.alloc.num_pages - 1, "a page leaked"
        assert self.cache.total_size() == p * len(cached)

    @invariant()
    def locked_prefixes_are_protected(self):
        locked = self.locked_prefixes()
        assert locked <= self.model.keys(), "a locked prefix is gone"
        assert self.cache.protected_size() == self.page_size * len(locked)

    def teardown(self):
        while self.reqs:
            self.cache_req(0, finished=True)
        for node, _, _ in self.locks:
            self.cache.unlock(node)
        self.locks.clear()
        assert self.cache.protected_size() == 0
        assert self.alloc.available_size() + self.cache.total_size() == self.alloc.total_size
        self.cache.reset()
        assert self.alloc.available_size() == self.alloc.total_size


class PagedCacheMachine(CacheMachine):
    page_size = 4
    alphabet = 2
    max_len = 24
    num_pages = 17


class NoOpCacheMachine(PagedCacheMachine):
    disable = True


def _settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, stateful_step_count=30, deadline=None)


TestRadixCachePageSize1 = CacheMachine.TestCase
TestRadixCachePageSize1.settings = _settings(250)
TestRadixCachePageSize4 = PagedCacheMachine.TestCase
TestRadixCachePageSize4.settings = _settings(250)
TestNoOpCache = NoOpCacheMachine.TestCase
TestNoOpCache.settings = _settings(30)

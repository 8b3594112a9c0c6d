"""Unit tests of the prefix caches against the real `PagedAllocator` and `ReqToTokenPool`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from arborlm.errors import OutOfMemoryError
from arborlm.radix_cache import (
    NoOpCache,
    PrefixCache,
    RadixCache,
    create_prefix_cache,
)
from arborlm.radix_cache.radix_cache import common_prefix_len
from arborlm.runtime.memory_pool import PagedAllocator, ReqToTokenPool
from arborlm.runtime.request import Req
from arborlm.runtime.sampling_params import SamplingParams


def make(page_size: int = 1, num_slots: int = 256, disable: bool = False):
    pool = ReqToTokenPool(max_reqs=8, max_context_len=128)
    alloc = PagedAllocator(num_slots, page_size)
    return pool, alloc, create_prefix_cache(disable, pool, alloc, page_size)


def put(cache: PrefixCache, tokens: list[int], extra_key: str | None = None) -> torch.Tensor:
    """Insert `tokens` with fresh slots, freeing the duplicates as a caller must."""
    slots = cache.allocator.alloc_range(0, len(tokens), 0)
    n_dup = cache.insert(tokens, slots, extra_key)
    cache.allocator.free(slots[:n_dup])
    return slots


def assert_accounted(cache: PrefixCache, held: int = 0) -> None:
    alloc = cache.allocator
    assert alloc.available_size() + cache.total_size() + held == alloc.total_size
    cache.check_integrity()


def admit(cache: PrefixCache, req: Req) -> None:
    """What the scheduler does at admission: match, lock, take a row, point it at the prefix."""
    match = cache.match_prefix(req.fill_ids, req.extra_key)
    cache.lock(match.node)
    req.req_pool_idx = cache.req_to_token_pool.alloc()
    cache.req_to_token_pool.write(req.req_pool_idx, 0, match.slots)
    req.cached_len = req.computed_len = len(match.slots)
    req.prefix_slots = match.slots
    req.last_node = match.node


def compute(cache: PrefixCache, req: Req, end: int) -> None:
    """Allocate KV for positions [computed_len, end) as a forward pass would."""
    row, start = req.req_pool_idx, req.computed_len
    last = int(cache.req_to_token_pool.req_to_token[row, start - 1]) if start else 0
    slots = cache.allocator.alloc_range(start, end, last)
    cache.req_to_token_pool.write(row, start, slots)
    req.computed_len = end


def new_req(tokens: list[int], extra_key: str | None = None) -> Req:
    return Req("r", tokens, SamplingParams(), extra_key=extra_key)


# --- tree operations ---------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_insert_then_match_returns_the_inserted_slots(page_size):
    _, _, cache = make(page_size)
    tokens = list(range(100, 100 + 2 * page_size))
    slots = put(cache, tokens)
    match = cache.match_prefix(tokens + [7])
    assert torch.equal(match.slots, slots)
    assert match.node.key == tokens and match.node.parent is cache.root
    assert cache.evictable_size() == len(tokens) and cache.protected_size() == 0
    assert_accounted(cache)


def test_partial_match_splits_the_node():
    _, alloc, cache = make(1)
    slots = put(cache, [1, 2, 3, 4, 5, 6])
    match = cache.match_prefix([1, 2, 3, 9])
    assert torch.equal(match.slots, slots[:3])
    assert match.node.key == [1, 2, 3] and list(match.node.children) == [4]
    tail = match.node.children[4]
    assert tail.key == [4, 5, 6] and torch.equal(tail.value, slots[3:])
    assert tail.parent is match.node and cache.root.children[1] is match.node
    free_before = alloc.available_size()
    put(cache, [1, 2, 3, 7, 8])
    assert alloc.available_size() == free_before - 2  # the 3 duplicate slots went back
    assert sorted(match.node.children) == [4, 7]
    assert cache.total_size() == 8
    assert_accounted(cache)


@pytest.mark.parametrize("page_size", [4, 16])
def test_pages_key_children_and_bound_splits(page_size):
    _, _, cache = make(page_size)
    p = page_size
    tokens = list(range(3 * p))
    slots = put(cache, tokens)
    assert list(cache.root.children) == [tuple(range(p))]
    # mismatch inside the second page: the match stops at the first page boundary
    probe = tokens[: p + 1] + [-1] + tokens[p + 2:]
    match = cache.match_prefix(probe)
    assert torch.equal(match.slots, slots[:p])
    assert [len(match.node.key), len(next(iter(match.node.children.values())).key)] == [p, 2 * p]
    # an unaligned query is truncated to whole pages
    assert len(cache.match_prefix(tokens[: 2 * p + 1]).slots) == 2 * p
    assert len(cache.match_prefix(tokens[: p - 1]).slots) == 0
    assert_accounted(cache)


def test_unaligned_insert_is_rejected():
    _, alloc, cache = make(4)
    with pytest.raises(AssertionError, match="unaligned"):
        cache.insert([1, 2, 3], alloc.alloc_range(0, 3, 0))


def test_extra_key_namespaces_are_isolated():
    _, _, cache = make(1)
    default = put(cache, [1, 2, 3])
    salted = put(cache, [1, 2, 3], extra_key="a")
    assert torch.equal(cache.match_prefix([1, 2, 3]).slots, default)
    assert torch.equal(cache.match_prefix([1, 2, 3], "a").slots, salted)
    miss = cache.match_prefix([1, 2, 3], "b")
    assert len(miss.slots) == 0 and miss.node.parent is None
    assert cache.root_for("b") is None and set(cache.roots()) == {None, "a"}
    cache.lock(miss.node)  # locking an empty match is harmless
    cache.unlock(miss.node)
    assert cache.evict(100) == 6
    assert cache.root_for("a") is None and cache.root_for(None) is cache.root
    assert_accounted(cache)


def test_lock_protects_the_path_from_eviction():
    _, _, cache = make(1)
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 3, 4, 5])
    put(cache, [9, 9])
    node = cache.match_prefix([1, 2, 3, 4, 5]).node
    cache.lock(node)
    cache.lock(node)
    assert cache.protected_size() == 5 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert len(cache.match_prefix([1, 2, 3, 4, 5]).slots) == 5
    cache.unlock(node)
    assert cache.evict(100) == 0  # still locked once
    cache.unlock(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    assert cache.evict(100) == 5
    assert_accounted(cache)


def test_eviction_is_least_recently_used_first():
    _, _, cache = make(1)
    a, b, c = [1, 1, 1], [2, 2, 2], [3, 3, 3]
    for tokens in (a, b, c):
        put(cache, tokens)
    cache.match_prefix(a)  # a becomes the most recent
    assert cache.evict(1) == 3
    assert len(cache.match_prefix(b).slots) == 0
    assert cache.evict(3) == 3
    assert len(cache.match_prefix(a).slots) == 3 and len(cache.match_prefix(c).slots) == 0
    assert_accounted(cache)


def test_a_parent_is_evicted_after_its_children():
    _, _, cache = make(1)
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    assert cache.evict(1) == 1  # one leaf, not the shared [1, 2]
    assert len(cache.match_prefix([1, 2]).slots) == 2
    assert cache.evict(2) == 3  # the other leaf, then [1, 2]
    assert cache.total_size() == 0 and not cache.root.children
    assert_accounted(cache)


def test_common_prefix_len_finds_every_mismatch_position():
    base = list(range(300))
    for pos in (0, 1, 63, 64, 65, 127, 128, 200, 299):
        other = base[:pos] + [-1] + base[pos + 1:]
        assert common_prefix_len(base, other, 0) == pos
    assert common_prefix_len(base, [7] + base, 1) == 300
    assert common_prefix_len(base, base[:10], 0) == 10


def test_reset_frees_everything_and_refuses_while_locked():
    _, alloc, cache = make(4)
    put(cache, list(range(8)))
    put(cache, list(range(4)) + [9] * 4, extra_key="x")
    node = cache.match_prefix(list(range(8))).node
    cache.lock(node)
    with pytest.raises(AssertionError, match="locked"):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert alloc.available_size() == alloc.total_size and cache.total_size() == 0
    assert cache.roots().keys() == {None}
    assert_accounted(cache)


def test_check_integrity_reports_a_slot_freed_behind_the_cache():
    _, alloc, cache = make(1)
    slots = put(cache, [1, 2, 3])
    alloc.free(slots[1:2])
    with pytest.raises(AssertionError, match="free list"):
        cache.check_integrity()


def test_check_integrity_reports_a_bad_lock_count():
    _, _, cache = make(1)
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    node = cache.match_prefix([1, 2, 3]).node
    cache.lock(node)
    node.parent.lock_ref = 0
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check_integrity()


# --- request-level operations ------------------------------------------------------------


def test_finished_request_is_cached_and_reused():
    pool, alloc, cache = make(1)
    first = new_req([5, 6, 7, 8, 9])
    admit(cache, first)
    compute(cache, first, 5)
    cache.cache_finished_req(first)
    assert first.last_node is None and cache.total_size() == 5
    pool.free(first.req_pool_idx)
    assert_accounted(cache)
    second = new_req([5, 6, 7, 8, 9, 10, 11])
    admit(cache, second)
    assert second.cached_len == 5 and cache.protected_size() == 5
    compute(cache, second, 7)
    cache.cache_finished_req(second)
    assert cache.total_size() == 7 and cache.protected_size() == 0
    assert_accounted(cache)


def test_finished_request_frees_the_slots_it_duplicated():
    """Two requests computed the same prompt concurrently: the second's copy is freed."""
    _, alloc, cache = make(1)
    a, b = new_req(list(range(10))), new_req(list(range(10)) + [42])
    for req in (a, b):
        admit(cache, req)
        compute(cache, req, req.total_len)
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)
    assert cache.total_size() == 11  # b's 10 duplicates were freed, its last token cached
    assert_accounted(cache)


def test_finished_request_frees_only_duplicates_beyond_its_cached_prefix():
    _, alloc, cache = make(1)
    put(cache, [1, 2, 3, 4])
    req = new_req([1, 2, 3, 4, 5, 6, 7, 8])
    admit(cache, req)
    compute(cache, req, 8)
    put(cache, [1, 2, 3, 4, 5, 6])  # someone else caches 5, 6 meanwhile
    cache.cache_finished_req(req)
    assert cache.total_size() == 8
    assert_accounted(cache)


@pytest.mark.parametrize("page_size", [4, 16])
def test_finished_request_frees_its_unaligned_tail(page_size):
    _, alloc, cache = make(page_size, num_slots=16 * page_size)
    req = new_req(list(range(2 * page_size + 3)))
    admit(cache, req)
    compute(cache, req, req.total_len)
    cache.cache_finished_req(req)
    assert cache.total_size() == 2 * page_size
    assert alloc.available_size() == alloc.total_size - 2 * page_size
    assert_accounted(cache)


def test_unfinished_request_moves_its_lock_and_row_to_the_tree():
    pool, alloc, cache = make(4)
    req = new_req(list(range(14)))
    admit(cache, req)
    compute(cache, req, 6)
    own_tail = pool.req_to_token[req.req_pool_idx, 4:6].clone()
    cache.cache_unfinished_req(req)
    assert req.cached_len == 4 and cache.protected_size() == 4
    assert torch.equal(pool.req_to_token[req.req_pool_idx, 4:6], own_tail)
    assert torch.equal(req.prefix_slots, cache.match_prefix(list(range(4))).slots)
    assert_accounted(cache, held=4)  # the partial page [4, 8) is the request's own
    compute(cache, req, 14)
    cache.cache_unfinished_req(req)
    assert req.cached_len == 12 and cache.protected_size() == 12
    assert_accounted(cache, held=4)
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0 and cache.total_size() == 12
    assert_accounted(cache)


def test_unfinished_request_adopts_the_cached_copy_of_its_duplicates():
    pool, alloc, cache = make(1)
    a, b = new_req(list(range(6))), new_req(list(range(6)))
    for req in (a, b):
        admit(cache, req)
        compute(cache, req, 6)
    cache.cache_unfinished_req(a)
    cache.cache_unfinished_req(b)  # b's own 6 slots are duplicates: freed, row re-pointed
    row_a = pool.req_to_token[a.req_pool_idx, :6]
    assert torch.equal(pool.req_to_token[b.req_pool_idx, :6], row_a)
    assert b.cached_len == 6 and cache.protected_size() == 6
    assert_accounted(cache)
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)
    assert cache.protected_size() == 0 and cache.total_size() == 6
    assert_accounted(cache)


# --- the no-op cache and the factory -----------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_noop_cache_keeps_nothing(page_size):
    pool, alloc, cache = make(page_size, disable=True)
    assert isinstance(cache, NoOpCache)
    req = new_req(list(range(2 * page_size + 1)))
    admit(cache, req)
    assert req.cached_len == 0 and req.last_node.parent is None
    compute(cache, req, req.total_len)
    cache.cache_unfinished_req(req)
    assert alloc.available_size() < alloc.total_size
    cache.cache_finished_req(req)
    assert alloc.available_size() == alloc.total_size
    slots = alloc.alloc_range(0, page_size, 0)
    assert cache.insert(list(range(page_size)), slots) == 0
    assert alloc.available_size() == alloc.total_size
    assert cache.evict(10) == 0 and cache.total_size() == 0
    assert len(cache.match_prefix(list(range(page_size))).slots) == 0
    cache.check_integrity()


def test_factory_picks_the_implementation():
    assert isinstance(make(disable=False)[2], RadixCache)
    assert isinstance(make(disable=True)[2], NoOpCache)


def test_import_stays_light():
    code = ("import sys, arborlm.radix_cache; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('transformers', 'triton', 'fastapi', 'xgrammar') "
            "or m.startswith('arborlm.runtime')]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_decode_steps_slots_come_and_are_written_at_once():
    """`alloc_slots(n)` hands out the slots n single allocations would, and `write_one_each`
    writes one position of each row, as per-request `write`s would."""
    one, many = PagedAllocator(50, 1), PagedAllocator(50, 1)
    singles = torch.cat([one.alloc_range(0, 1, 0) for _ in range(5)])
    assert torch.equal(many.alloc_slots(5), singles)
    assert one.available_size() == many.available_size() == 50 - 1 - 5
    pool, expected = ReqToTokenPool(4, 10), ReqToTokenPool(4, 10)
    rows, positions = [3, 0, 2], [7, 0, 4]
    slots = torch.tensor([11, 12, 13])
    pool.write_one_each(rows, positions, slots)
    for r, p, s in zip(rows, positions, slots):
        expected.write(r, p, s[None])
    assert torch.equal(pool.req_to_token, expected.req_to_token)
    with pytest.raises(OutOfMemoryError):
        many.alloc_slots(100)

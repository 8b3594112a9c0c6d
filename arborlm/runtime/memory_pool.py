"""KV memory: the request→token table, the per-layer KV pool, and a paged slot allocator.

Three objects, each with one job:

- `ReqToTokenPool`: one row per live request; `req_to_token[row, pos]` is the KV slot that
  holds the request's token at position `pos`.
- `KVPool`: per layer, K and V buffers `[num_slots, num_kv_heads, head_dim]` indexed by slot.
  Slot 0 is never handed out: padded positions point at it, so gathers never go out of range.
- `PagedAllocator`: hands out slots a page at a time from a free list. A request's positions
  `[k*P, (k+1)*P)` live in one page, at offsets `pos % P`; with page size 1 it is a plain slot
  allocator. It knows nothing about requests or the prefix cache.

Invariant (checked by `Scheduler.check_integrity` when idle): free slots + slots held by the
prefix cache == all usable slots.
"""

from __future__ import annotations

import torch

from arborlm.errors import OutOfMemoryError


class ReqToTokenPool:
    """Rows of token→slot mappings, one per running request."""

    def __init__(self, max_reqs: int, max_context_len: int, device: str = "cpu"):
        self.size = max_reqs
        self.max_context_len = max_context_len
        # [max_reqs, max_context_len] int64: position -> KV slot (0 = padding)
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64,
                                        device=device)
        self._free = list(range(max_reqs - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        assert row not in self._free, f"req_to_token row {row} freed twice"
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start:start + len(slots)] = slots

    def write_one_each(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """`req_to_token[rows[i], positions[i]] = slots[i]` for every i (a decode step's)."""
        table = self.req_to_token
        if len(rows) == 1:  # a slice write is the cheapest call
            table[rows[0], positions[0]:positions[0] + 1] = slots
            return
        width = self.max_context_len
        flat = torch.tensor([r * width + p for r, p in zip(rows, positions)], dtype=torch.int64,
                            device=table.device)
        table.view(-1).index_copy_(0, flat, slots.to(table.device))

    def clear(self) -> None:
        self._free = list(range(self.size - 1, -1, -1))


class KVPool:
    """Per-layer K and V buffers indexed by slot."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str = "cpu"):
        self.num_slots = num_slots  # includes the padding slot 0
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v `[T, num_kv_heads, head_dim]` into slots `loc` `[T]` (distinct slots)."""
        self.k_buffer[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer[layer].index_copy_(0, loc, v.to(self.dtype))


class PagedAllocator:
    """Free list of pages; slots are `page * page_size + offset`.

    Page 0 is reserved (it holds the padding slot 0), so usable slots are
    `[page_size, num_pages * page_size)`.
    """

    def __init__(self, num_slots: int, page_size: int, device: str = "cpu"):
        assert num_slots % page_size == 0, "num_slots must be a multiple of page_size"
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        # pop() from the end: lower pages are handed out first
        self._free_pages: list[int] = list(range(self.num_pages - 1, 0, -1))
        # 1 = free, per page; a bytearray, as a decode step allocates a page per request and a
        # tensor write per allocation costs more than the allocation itself.
        self._is_free = bytearray(b"\x01") * self.num_pages
        self._is_free[0] = 0

    @property
    def total_size(self) -> int:
        """Usable slots (all pages but the reserved one)."""
        return (self.num_pages - 1) * self.page_size

    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def _take_pages(self, n: int) -> list[int]:
        if n > len(self._free_pages):
            raise OutOfMemoryError(f"KV pool exhausted: need {n} pages, "
                                   f"{len(self._free_pages)} free")
        pages = self._free_pages[-n:] if n else []
        del self._free_pages[len(self._free_pages) - n:]
        pages.reverse()
        is_free = self._is_free
        for page in pages:
            is_free[page] = 0
        return pages

    def pages_needed(self, start: int, end: int) -> int:
        """New pages to hold positions `[start, end)` when `[0, start)` is already held."""
        p = self.page_size
        return -(-end // p) - -(-start // p)

    def alloc_slots(self, n: int) -> torch.Tensor:
        """`n` slots, one page each (page size 1 only). Raises `OutOfMemoryError` if they run
        out."""
        assert self.page_size == 1, "alloc_slots hands out single-slot pages"
        return torch.tensor(self._take_pages(n), dtype=torch.int64)

    def alloc_range(self, start: int, end: int, last_slot: int) -> torch.Tensor:
        """Slots for positions `[start, end)` of one request.

        `last_slot` is the slot of position `start - 1` (ignored when `start` is page-aligned):
        positions in the same page continue in it. Raises `OutOfMemoryError` if pages run out.
        """
        p = self.page_size
        n = end - start
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        if p == 1:
            return torch.tensor(self._take_pages(n), dtype=torch.int64)
        out = torch.empty(n, dtype=torch.int64)
        i = 0
        if start % p:
            take = min(p - start % p, n)
            out[:take] = torch.arange(last_slot + 1, last_slot + 1 + take)
            i = take
        pages = self._take_pages(-(-(n - i) // p)) if i < n else []
        if pages:
            slots = (torch.tensor(pages, dtype=torch.int64)[:, None] * p
                     + torch.arange(p)[None, :]).flatten()
            out[i:] = slots[: n - i]
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages that hold `slots` to the free list.

        With page size > 1 the caller frees whole pages it owns: every slot of a page it passes
        must be its own (a partial page at a request's tail is owned by that request alone).
        """
        if slots.numel() == 0:
            return
        pages = torch.unique(slots // self.page_size) if self.page_size > 1 else slots
        page_list = pages.tolist()
        is_free = self._is_free
        for page in page_list:
            assert page != 0, "padding page freed"
            assert not is_free[page], "KV page freed twice"
            is_free[page] = 1
        self._free_pages.extend(page_list)

    def free_page_set(self) -> set[int]:
        return set(self._free_pages)

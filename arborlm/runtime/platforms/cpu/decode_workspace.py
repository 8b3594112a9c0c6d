"""`DecodeWorkspace`: the running requests' K/V kept dense between decode steps (torch_native).

A `torch_native` decode step needs every request's keys and values as one padded batch,
`[Hkv, B, L, D]`. Gathering it from the paged pool copies the whole history every step, so the
K/V is streamed three times (read from the pool, written to the copy, read by the matmul).
While the same requests decode step after step, the workspace keeps last step's padded batch
and appends each request's new token to it, so a step streams the history once.

With cascade decode (requests in groups that share a cached prefix, see `torch_native`), the
workspace holds each group's shared prefix once (`[Hkv, NG, P, D]`, constant while the batch
continues) and each request's own keys from the end of its group's prefix (its `offset`).

It is valid only while the batch is the previous decode step's requests, in the same order,
each one token longer, on the same pool, with each one's previous token still at the slot that
step wrote, and no other step in between. Requests that finished (or were retracted) since are
dropped from it by one copy of the others' rows (a group may lose members; its prefix stays);
anything else (an extend step, a request joining, a reordering, a cache rewrite) makes the next
step refill it from the pool. Slots past a request's length hold finite stale values that the
attention mask hides. Its size is bounded (`byte_limit`): as large as the KV pool itself, but
never more than half the memory free when it is sized, and at least `MIN_BYTES`; a batch that
would need more decodes from the pool as before.

This module holds buffers and bookkeeping only; the attention itself is in `torch_native`.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.memory_pool import KVPool

# The workspace may always hold this much (K and V, all layers), whatever the free memory; see
# `byte_limit` for its bound. (128 requests of 1,100 tokens of a 40M model need 2.5 GB of it;
# decoding them from the pool instead is several times slower: docs/performance.md.)
MIN_BYTES = 512 << 20
# Positions allocated past the longest sequence when (re)filling, rounded up to a multiple.
HEADROOM = 64


@dataclass
class Layout:
    """How a decode batch's keys are split: per request, where its own keys start (`offsets`,
    the length of its group's shared prefix, else 0) and its group (`groups`, -1 for none);
    `prefix_width` is the longest group prefix, `num_groups` the number of groups."""

    offsets: list[int]
    groups: list[int]
    num_groups: int = 0
    prefix_width: int = 0

    def keep(self, positions: list[int]) -> Layout:
        """The layout of the requests at `positions` (groups and their prefixes stay)."""
        return Layout([self.offsets[i] for i in positions], [self.groups[i] for i in positions],
                       self.num_groups, self.prefix_width)


def byte_limit(pool: KVPool) -> int:
    """Most bytes a workspace for `pool` may take: the pool's own size, at most half the free
    memory (host or device), at least `MIN_BYTES`."""
    pool_bytes = 2 * pool.num_layers * pool.num_slots * pool.num_kv_heads * pool.head_dim \
        * pool.dtype.itemsize
    if torch.device(pool.device).type == "cuda":
        free = torch.cuda.mem_get_info(pool.device)[0]
    else:
        free = psutil.virtual_memory().available
    return max(MIN_BYTES, min(pool_bytes, free // 2))


class DecodeWorkspace:
    """Per-layer K and V buffers `[Hkv, B, cap, D]` of the requests decoding together, and
    their groups' shared prefixes `[Hkv, NG, P, D]` (empty without cascade)."""

    def __init__(self) -> None:
        self.rows: list[int] | None = None  # req_to_token rows of the last decode step
        self.lens: list[int] = []
        self.layout: Layout | None = None
        self.pool: KVPool | None = None  # the pool the buffers were filled from
        self.last_loc: torch.Tensor | None = None  # [B] slots the last decode step wrote
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pk: list[torch.Tensor] = []
        self.pv: list[torch.Tensor] = []

    def invalidate(self) -> None:
        """Forget the last step's batch (an extend step ran, or decoding left the workspace)."""
        self.rows = None

    def continues(self, batch: ForwardBatch) -> bool:
        """Whether this decode step continues the last one: its requests are the last step's
        (some may have left; none joined; same order), each one token longer, on the same pool,
        each one's previous token still at the slot the last step wrote, and they fit. Then the
        step appends (after dropping the rows of requests that left). Records the step."""
        keep = self._kept(batch)
        ok = keep is not None and max(self._own_lens(batch, keep)) <= self.capacity
        if ok:
            table = batch.req_to_token_pool.req_to_token
            prev_slots = table[batch.req_pool_indices, batch.seq_lens - 2]  # [B]
            dropped = len(keep) < len(self.lens)
            kept = torch.tensor(keep, device=prev_slots.device) if dropped else None
            ok = bool(torch.equal(prev_slots, self.last_loc if kept is None
                                  else self.last_loc[kept]))
            if ok and kept is not None:  # requests left: keep the others' rows, in order
                self.k = [k.index_select(1, kept) for k in self.k]
                self.v = [v.index_select(1, kept) for v in self.v]
                self.layout = self.layout.keep(keep)
        if ok:
            self.rows, self.lens = batch.req_pool_indices.tolist(), list(batch.seq_lens_cpu)
        else:
            self.invalidate()
        self.last_loc = batch.out_cache_loc
        return ok

    def _own_lens(self, batch: ForwardBatch, keep: list[int]) -> list[int]:
        offsets = self.layout.offsets
        return [n - offsets[i] for n, i in zip(batch.seq_lens_cpu, keep)]

    def _kept(self, batch: ForwardBatch) -> list[int] | None:
        """Positions in the last step's batch of this step's requests, when it continues it."""
        if self.rows is None or not self.k or self.pool is not batch.kv_pool:
            return None
        where = {row: i for i, row in enumerate(self.rows)}
        keep = [where.get(row, -1) for row in batch.req_pool_indices.tolist()]
        if -1 in keep or any(a >= b for a, b in zip(keep, keep[1:])):
            return None  # a request joined, or the order changed
        if any(n != self.lens[i] + 1 for n, i in zip(batch.seq_lens_cpu, keep)):
            return None
        return keep

    def prepare(self, batch: ForwardBatch, layout: Layout) -> bool:
        """Size the buffers for a new batch (each layer then `fill`s them from its gather);
        False when that would take more than `byte_limit` (the step gathers from the pool)."""
        pool, lens = batch.kv_pool, batch.seq_lens_cpu
        cap = self.k[0].shape[2] if self.k else 0
        own = max(n - o for n, o in zip(lens, layout.offsets))
        want = -(-(own + HEADROOM) // HEADROOM) * HEADROOM
        shape = (pool.num_kv_heads, len(lens), max(want, cap), pool.head_dim)
        prefix = (pool.num_kv_heads, layout.num_groups, layout.prefix_width, pool.head_dim)
        same_own = bool(self.k) and tuple(self.k[0].shape) == shape \
            and self.k[0].dtype == pool.dtype
        same_prefix = bool(self.pk) and tuple(self.pk[0].shape) == prefix \
            and self.pk[0].dtype == pool.dtype
        if not (same_own and same_prefix):
            # Buffers to replace are freed first: the limit counts them as free memory.
            if not same_own:
                self.k, self.v = [], []
            if not same_prefix:
                self.pk, self.pv = [], []
            elements = torch.Size(shape).numel() + torch.Size(prefix).numel()
            if 2 * pool.num_layers * elements * pool.dtype.itemsize > byte_limit(pool):
                self.k, self.v, self.pk, self.pv = [], [], [], []
                return False
            if not same_own:
                self.k, self.v = self._buffers(shape, pool), self._buffers(shape, pool)
            if not same_prefix:
                self.pk, self.pv = self._buffers(prefix, pool), self._buffers(prefix, pool)
        self.rows, self.lens, self.pool = batch.req_pool_indices.tolist(), list(lens), pool
        self.layout = layout
        return True

    @staticmethod
    def _buffers(shape: tuple[int, ...], pool: KVPool) -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=pool.dtype, device=pool.device)
                for _ in range(pool.num_layers)]

    @property
    def capacity(self) -> int:
        """Own positions each request has room for."""
        return self.k[0].shape[2] if self.k else 0

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a layer's gathered own keys, k/v `[Hkv, B, L, D]`."""
        width = k.shape[2]
        self.k[layer][:, :, :width].copy_(k)
        self.v[layer][:, :, :width].copy_(v)

    def fill_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a layer's gathered group prefixes, k/v `[Hkv, NG, P, D]`."""
        self.pk[layer].copy_(k)
        self.pv[layer].copy_(v)

    def prefix(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups' prefix K and V, `[Hkv * NG, P, D]` each."""
        hkv, groups, width, d = self.pk[layer].shape
        return (self.pk[layer].view(hkv * groups, width, d),
                self.pv[layer].view(hkv * groups, width, d))

    def append_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows `[Hkv * B]` (head-major) of the buffers seen as `[Hkv * B * cap, D]` where each
        request's token at own position `positions` `[B]` goes."""
        hkv, bsz, cap, _ = self.k[0].shape
        heads = torch.arange(hkv, device=positions.device)[:, None] * bsz  # [Hkv, 1]
        reqs = torch.arange(bsz, device=positions.device)[None, :]  # [1, B]
        return ((heads + reqs) * cap + positions[None, :]).flatten()

    def append(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' k/v `[B, Hkv, D]` at `rows` (from `append_rows`)."""
        d = k.shape[-1]
        self.k[layer].view(-1, d).index_copy_(0, rows, k.transpose(0, 1).reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, rows, v.transpose(0, 1).reshape(-1, d))

    def view(self, layer: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `width` own positions, `[Hkv * B, width, D]` (strided views)."""
        k, v = self.k[layer], self.v[layer]
        hkv, bsz, cap, d = k.shape
        return (k.view(hkv * bsz, cap, d)[:, :width], v.view(hkv * bsz, cap, d)[:, :width])

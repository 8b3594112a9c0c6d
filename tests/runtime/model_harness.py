"""Drive a model through EXTEND and DECODE steps without the scheduler.

`ModelHarness` owns a small `ReqToTokenPool`, `KVPool` and `PagedAllocator` and the
`torch_native` attention backend (on a CPU, the CPU backend that serves its name), builds
`ForwardBatch` objects by hand and returns logits.
Tests use it to check the model against `transformers` step by step (prefill, chunked extend,
decode, mixed batches). It does no scheduling, caching or sampling.
"""

from __future__ import annotations

import torch
from torch import nn

from arborlm.runtime.attention.registry import create_attention_backend
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
from arborlm.runtime.memory_pool import KVPool, PagedAllocator, ReqToTokenPool


class ModelHarness:
    """A model plus just enough KV memory to run requests by hand."""

    def __init__(self, model: nn.Module, config: ModelConfig, max_reqs: int = 4,
                 max_context: int = 128, num_slots: int = 512):
        self.model = model
        self.req_pool = ReqToTokenPool(max_reqs, max_context)
        self.kv_pool = KVPool(num_slots, config.num_layers, config.num_kv_heads,
                              config.head_dim, config.dtype)
        self.allocator = PagedAllocator(num_slots, page_size=1)
        self.backend = create_attention_backend("torch_native", "cpu")
        self.seq_lens: dict[int, int] = {}

    def new_request(self) -> int:
        row = self.req_pool.alloc()
        assert row is not None, "harness out of request rows"
        self.seq_lens[row] = 0
        return row

    def _place(self, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate slots for the next `n` tokens of `row`; returns (positions, slots) `[n]`."""
        start = self.seq_lens[row]
        last = int(self.req_pool.req_to_token[row, start - 1]) if start else 0
        slots = self.allocator.alloc_range(start, start + n, last)
        self.req_pool.write(row, start, slots)
        self.seq_lens[row] = start + n
        return torch.arange(start, start + n), slots

    def extend(self, rows: list[int], chunks: list[list[int]],
               logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """One EXTEND step: `chunks[i]` are new tokens of request `rows[i]` on top of what it
        already holds. Returns logits `[N, vocab]` of `logits_indices` rows (all if None)."""
        prefix = [self.seq_lens[r] for r in rows]
        placed = [self._place(r, len(c)) for r, c in zip(rows, chunks)]
        batch = self._batch(ForwardMode.EXTEND, rows, sum(chunks, []), placed, logits_indices)
        batch.extend_prefix_lens_cpu = prefix
        batch.extend_seq_lens_cpu = [len(c) for c in chunks]
        return self._run(batch)

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """One DECODE step: one new token per request. Returns logits `[B, vocab]`."""
        placed = [self._place(r, 1) for r in rows]
        return self._run(self._batch(ForwardMode.DECODE, rows, tokens, placed, None))

    def _batch(self, mode: ForwardMode, rows: list[int], tokens: list[int],
               placed: list[tuple[torch.Tensor, torch.Tensor]],
               logits_indices: torch.Tensor | None) -> ForwardBatch:
        seq_lens = [self.seq_lens[r] for r in rows]
        return ForwardBatch(
            mode=mode, batch_size=len(rows),
            input_ids=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.cat([p for p, _ in placed]),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat([s for _, s in placed]),
            req_to_token_pool=self.req_pool, kv_pool=self.kv_pool, seq_lens_cpu=seq_lens,
            logits_indices=logits_indices)

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        batch.attn_backend = self.backend
        self.backend.init_forward_metadata(batch)
        with torch.inference_mode():
            hidden = self.model(batch)
            return self.model.compute_logits(hidden)

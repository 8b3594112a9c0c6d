"""`triton` attention: paged decode and extend kernels written in Triton.

`init_forward_metadata` turns the batch's host-side lengths into the few small device tensors
the kernels read (one host-to-device copy per step, shared by every layer); `forward_extend` and
`forward_decode` launch the kernels of `triton_kernels` over the shared KV pool. Works for any
page size, since the kernels gather K/V per position through `req_to_token`.

Runs on a GPU (written for NVIDIA), and on CPU only in Triton's interpreter
(`TRITON_INTERPRET=1` set before Triton is first imported), which is how CI tests it. It is not
a fallback for CPU serving: the interpreter is orders of magnitude slower than `torch_native`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.errors import ArborLMError
from arborlm.runtime.attention.base import AttentionBackend, AttentionLayerSpec
from arborlm.runtime.attention.triton_kernels import (
    INTERPRET,
    decode_attention_fwd,
    extend_attention_fwd,
    num_kv_splits,
)
from arborlm.runtime.forward_batch import ForwardBatch


@dataclass
class _DecodeMeta:
    kv_splits: torch.Tensor  # [B] int32 splits of each request's context
    grid_splits: int  # splits in the launch grid (from the longest sequence)


@dataclass
class _ExtendMeta:
    prefix_lens: torch.Tensor  # [B] int32 cached positions before the new tokens
    extend_lens: torch.Tensor  # [B] int32 new tokens
    q_start: torch.Tensor  # [B] int32 first row of each request's new tokens in q
    max_extend_len: int


class TritonBackend(AttentionBackend):
    """Attention through the Triton kernels; stateless between steps."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        if device.type == "cpu" and not INTERPRET:
            raise ArborLMError(
                "the triton attention backend needs a GPU; on CPU it runs only in Triton's "
                "interpreter (set TRITON_INTERPRET=1 before triton is imported)")
        if batch.mode.is_decode:
            splits, grid_splits = num_kv_splits(batch.seq_lens, max(batch.seq_lens_cpu))
            batch.attn_metadata = _DecodeMeta(kv_splits=splits, grid_splits=grid_splits)
            return
        prefix = batch.extend_prefix_lens_cpu
        extend = batch.extend_seq_lens_cpu
        starts = [0] * len(extend)
        for i in range(1, len(extend)):
            starts[i] = starts[i - 1] + extend[i - 1]
        lens = torch.tensor([prefix, extend, starts], dtype=torch.int32).to(
            device, non_blocking=True)  # [3, B]
        batch.attn_metadata = _ExtendMeta(prefix_lens=lens[0], extend_lens=lens[1],
                                          q_start=lens[2], max_extend_len=max(extend, default=0))

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        meta: _ExtendMeta = batch.attn_metadata
        return extend_attention_fwd(
            q, batch.kv_pool.k_buffer[layer.layer_id], batch.kv_pool.v_buffer[layer.layer_id],
            batch.req_to_token_pool.req_to_token, batch.req_pool_indices,
            meta.prefix_lens, meta.extend_lens, meta.q_start, meta.max_extend_len,
            layer.scaling)  # [T, H, D]

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        meta: _DecodeMeta = batch.attn_metadata
        return decode_attention_fwd(
            q, batch.kv_pool.k_buffer[layer.layer_id], batch.kv_pool.v_buffer[layer.layer_id],
            batch.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens,
            meta.kv_splits, meta.grid_splits, layer.scaling)  # [B, H, D]

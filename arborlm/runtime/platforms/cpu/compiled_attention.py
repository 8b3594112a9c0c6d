"""Decode attention that `torch.compile` can trace: the attention of compiled decode steps.

`CompiledDecodeAttention` stands in for the attention backend while a decode step runs inside
`torch.compile` (see `compiled_decode`; the fused decode step reads the same metadata). It has no
host-side decisions and no Python state per step: every request's keys are read from the paged pool
through a `[B, L]` slot table (`L` = the longest sequence, a dynamic dimension). On a CPU with
AVX-512 that is ArborLM's kernel (`cpu_kernels.decode_attention_paged`, an opaque call in the graph,
the arithmetic of eager decode's kernel); elsewhere the keys are gathered, padding positions masked
by the sequence lengths, and the arithmetic follows `torch_native`'s matmul path (scores in the
activation dtype, scaled and softmaxed in float32, probabilities cast back), so greedy results agree
with the eager path.

Not here: extend steps, cascade (shared-prefix) decode, the dense decode workspace; a step that
wants those runs eagerly with the CPU attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.runtime.attention.base import AttentionLayerSpec
from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels


@dataclass
class CompiledDecodeMeta:
    """The per-step tensors the traced attention reads (built eagerly, before the step)."""

    slots: torch.Tensor  # [B, L] int64 KV slots of each request's positions (row tails: junk)
    seq_lens: torch.Tensor  # [B] int64 lengths after this step (positions >= length: masked)


def compiled_decode_metadata(batch: ForwardBatch, ahead: int = 0) -> CompiledDecodeMeta:
    """Slot table of a decode batch: `req_to_token` rows cut to the longest sequence (and
    `ahead` more positions, for the steps that `FusedDecodeStep.run_ahead` runs after it)."""
    width = max(batch.seq_lens_cpu) + ahead
    table = batch.req_to_token_pool.req_to_token
    if batch.batch_size == 1:
        slots = table[int(batch.req_pool_indices[0]), :width].unsqueeze(0)  # [1, L]
    else:
        slots = table[batch.req_pool_indices, :width]  # [B, L]
    return CompiledDecodeMeta(slots=slots, seq_lens=batch.seq_lens)


class CompiledDecodeAttention:
    """The `attn_backend` of a traced decode step (`forward` only; no metadata hooks)."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        # Decided here, eagerly: the traced step only reads the flag.
        self.kernel = torch.device(device).type == "cpu" \
            and cpu_kernels.attention_available(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        """q `[B, H*D]`, the new tokens' k/v `[B, Hkv*D]` -> `[B, H*D]`; stores k/v first."""
        meta: CompiledDecodeMeta = batch.attn_metadata
        hkv, d = layer.num_kv_heads, layer.head_dim
        bsz, group = q.shape[0], layer.num_heads // hkv
        k_buf = batch.kv_pool.k_buffer[layer.layer_id]  # [S, Hkv, D]
        v_buf = batch.kv_pool.v_buffer[layer.layer_id]
        k_buf.index_copy_(0, batch.out_cache_loc, k.view(bsz, hkv, d).to(k_buf.dtype))
        v_buf.index_copy_(0, batch.out_cache_loc, v.view(bsz, hkv, d).to(v_buf.dtype))
        if self.kernel and q.dtype == k_buf.dtype and cpu_kernels.attention_fits(q.dtype, group, d):
            out = cpu_kernels.decode_attention_paged(q.view(bsz, layer.num_heads, d), k_buf,
                                                     v_buf, meta.slots, meta.seq_lens,
                                                     layer.scaling)
            return out.view(bsz, layer.num_heads * d)
        width = meta.slots.shape[1]
        valid = torch.arange(width, device=q.device)[None, :] < meta.seq_lens[:, None]  # [B, L]
        slots = torch.where(valid, meta.slots, 0)  # padding reads the reserved slot 0
        # Products and sums rather than batched matmuls: the compiler fuses the gather, the
        # products and the reductions into single loops (a bmm is a library call per layer).
        keys = k_buf[slots].to(q.dtype).permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, L, D]
        values = v_buf[slots].to(q.dtype).permute(0, 2, 1, 3)[:, :, None]
        qh = q.view(bsz, hkv, group, 1, d)
        scores = (qh * keys).sum(dim=-1).float() * layer.scaling  # [B, Hkv, G, L]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = (probs[..., None] * values).sum(dim=-2)  # [B, Hkv, G, D]
        return out.reshape(bsz, layer.num_heads * d)

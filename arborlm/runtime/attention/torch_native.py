"""`torch_native` attention: plain PyTorch over the paged KV pool. The reference backend.

Runs on CPU and GPU and is what CI uses. Extend attends request by request (prompts differ in
length and prefix); decode gathers every request's K/V into one padded batch so a decode step
costs a handful of tensor ops per layer, not one per request. Grouped-query heads are handled by
viewing the query heads as `[num_kv_heads, group]` instead of repeating K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.runtime.attention.base import AttentionBackend, AttentionLayerSpec
from arborlm.runtime.forward_batch import ForwardBatch


@dataclass
class _DecodeMeta:
    slots: torch.Tensor  # [B, L] int64 KV slots, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, L] additive mask: 0 for real keys, -inf for padding


@dataclass
class _ExtendMeta:
    slots: list[torch.Tensor]  # per request: [seq_len] KV slots
    masks: list[torch.Tensor | None]  # per request: [ext, seq_len] bool (True = attend) or None


class TorchNativeBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token_pool.req_to_token
        if batch.mode.is_decode:
            max_len = max(batch.seq_lens_cpu)
            rows = batch.req_pool_indices
            slots = table[rows, :max_len]  # [B, L]
            pos = torch.arange(max_len, device=slots.device)
            valid = pos[None, :] < batch.seq_lens[:, None]  # [B, L]
            slots = torch.where(valid, slots, torch.zeros_like(slots))
            mask = torch.zeros(valid.shape, dtype=torch.float32, device=slots.device)
            mask.masked_fill_(~valid, float("-inf"))
            batch.attn_metadata = _DecodeMeta(slots=slots, mask=mask[:, None, None, :])
            return
        slots, masks = [], []
        rows = batch.req_pool_indices.tolist()
        for row, prefix, ext in zip(rows, batch.extend_prefix_lens_cpu,
                                    batch.extend_seq_lens_cpu):
            seq = prefix + ext
            slots.append(table[row, :seq])
            if prefix == 0:
                masks.append(None)  # plain causal
            else:
                q_pos = torch.arange(prefix, seq)[:, None]
                k_pos = torch.arange(seq)[None, :]
                masks.append(k_pos <= q_pos)  # [ext, seq]
        batch.attn_metadata = _ExtendMeta(slots=slots, masks=masks)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        meta: _ExtendMeta = batch.attn_metadata
        k_buf = batch.kv_pool.k_buffer[layer.layer_id]
        v_buf = batch.kv_pool.v_buffer[layer.layer_id]
        out = torch.empty_like(q)
        start = 0
        for ext, slots, mask in zip(batch.extend_seq_lens_cpu, meta.slots, meta.masks):
            qi = q[start:start + ext].transpose(0, 1)  # [H, ext, D]
            ki = k_buf[slots].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
            vi = v_buf[slots].transpose(0, 1).to(q.dtype)
            oi = torch.nn.functional.scaled_dot_product_attention(
                qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                attn_mask=None if mask is None else mask,
                is_causal=mask is None, scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )  # [1, H, ext, D]
            out[start:start + ext] = oi[0].transpose(0, 1)
            start += ext
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        meta: _DecodeMeta = batch.attn_metadata
        bsz, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // hkv
        pool = batch.kv_pool
        k = pool.k_buffer[layer.layer_id][meta.slots].view(bsz, -1, hkv * d)  # [B, L, Hkv*D]
        v = pool.v_buffer[layer.layer_id][meta.slots].view(bsz, -1, hkv * d)
        k, v = k.to(q.dtype), v.to(q.dtype)
        # Grouped-query attention as two plain batched matmuls over the gathered cache, with
        # the queries laid out block-diagonally: query head (h, g) holds its vector in KV head
        # h's block and zeros elsewhere. It spends Hkv× the (small) decode FLOPs but reads K and
        # V once, contiguously, with no per-head copies.
        qg = q.view(bsz, hkv, group, d)  # [B, Hkv, G, D]
        qb = torch.zeros(bsz, hkv, group, hkv, d, dtype=q.dtype, device=q.device)
        idx = torch.arange(hkv, device=q.device)
        qb[:, idx, :, idx] = qg.transpose(0, 1)  # [Hkv, B, G, D] into the diagonal blocks
        qb = qb.view(bsz, hkv * group, hkv * d)  # [B, H, Hkv*D]
        scores = torch.bmm(qb, k.transpose(1, 2)).float()  # [B, H, L]
        scores.mul_(layer.scaling).add_(meta.mask[:, 0])
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.bmm(probs, v).view(bsz, hkv, group, hkv, d)  # [B, Hkv, G, Hkv, D]
        out = out[:, idx, :, idx]  # [Hkv, B, G, D]: each head's own block
        return out.transpose(0, 1).reshape(bsz, layer.num_heads, d)

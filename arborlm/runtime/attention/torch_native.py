"""`torch_native` attention: plain PyTorch over the paged KV pool. The reference backend.

It runs wherever PyTorch runs, keeps no state between steps, and is what the other backends
are tested against. Extend attends request by request with `scaled_dot_product_attention` (a
request on a cached prefix gathers its slots from the pool, with a causal mask offset by the
prefix). Decode gathers every request's keys into one padded batch laid out KV-head-major
(`[Hkv * B, L, D]`) with a single `index_select` on the pool viewed as rows of one head, and
attends with two batched matmuls (each KV head's group of query heads against its own keys)
around a float32 softmax.

On a CPU the engine serves this backend's name with `arborlm.runtime.platforms.cpu.attention`
(ArborLM's kernels, a decode workspace, cascade attention, deterministic inference), which
computes the same attention and shares the pieces here (`padding_mask`, `attend_padded`,
`attend_causal`).

Not here: sliding windows, custom masks, CUDA graphs (the gather is sized by host lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from arborlm.runtime.attention.base import AttentionBackend, AttentionLayerSpec
from arborlm.runtime.forward_batch import ForwardBatch


@dataclass
class _DecodeGather:
    index: torch.Tensor  # [Hkv * B * L] int64 rows of the pool seen as [slots * Hkv, D]
    mask: torch.Tensor  # [1, B, 1, L] float32: 0 for real keys, -inf for padding
    width: int  # L


@dataclass
class _ExtendMeta:
    slots: list[torch.Tensor | None]  # per request: [seq_len] KV slots, None without a prefix
    starts: list[int]  # first row of each request's new tokens, and the total at the end


def padding_mask(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """`[1, B, 1, width]` float32: 0 for positions below each request's length, else -inf."""
    pos = torch.arange(width, device=seq_lens.device)
    mask = torch.zeros((1, seq_lens.shape[0], 1, width), dtype=torch.float32, device=pos.device)
    return mask.masked_fill_(pos >= seq_lens[:, None, None], float("-inf"))


def head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of the pool seen as `[slots * Hkv, D]` for `slots` `[..., L]`, KV-head-major:
    `[Hkv * ... * L]`."""
    heads = torch.arange(num_kv_heads, device=slots.device).view(-1, *([1] * slots.dim()))
    return (slots.unsqueeze(0) * num_kv_heads + heads).reshape(-1)


def attend_padded(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """Decode attention over padded keys as two batched matmuls around a float32 softmax:
    qh `[Hkv * B, G, D]`, k/v `[Hkv * B, L, D]`, mask `[1, B, 1, L]` -> `[Hkv * B, G, D]`."""
    rows, group, _ = qh.shape
    width = k.shape[1]
    hkv = rows // mask.shape[1]
    scores = torch.bmm(qh, k.transpose(1, 2)).float()  # [Hkv * B, G, L]
    scores = scores.view(hkv, -1, group, width).mul_(scaling).add_(mask)
    probs = torch.softmax(scores, dim=-1).to(qh.dtype)  # [Hkv, B, G, L]
    return torch.bmm(probs.view(rows, group, width), v)


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                  prefix: int) -> torch.Tensor:
    """One request's extend attention with `scaled_dot_product_attention`: q `[E, H, D]` (its
    new tokens, after `prefix` cached ones), k/v `[prefix + E, Hkv, D]` -> `[E, H, D]`."""
    ext = q.shape[0]
    mask = None
    if prefix:  # new token t (position prefix + t) sees the positions up to its own
        q_pos = torch.arange(prefix, prefix + ext, device=q.device)[:, None]
        mask = torch.arange(prefix + ext, device=q.device)[None, :] <= q_pos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, E, D]
        k.transpose(0, 1).unsqueeze(0).to(q.dtype),  # [1, Hkv, S, D]
        v.transpose(0, 1).unsqueeze(0).to(q.dtype),
        attn_mask=mask, is_causal=mask is None, scale=scaling,
        enable_gqa=q.shape[1] != k.shape[1])  # [1, H, E, D]
    return out[0].transpose(0, 1)


class TorchNativeBackend(AttentionBackend):
    """The reference: stateless, plain PyTorch, any device."""

    def cuda_graph_unsupported_reason(self, kv_dtype: torch.dtype) -> str | None:
        return ("the torch_native attention backend (TorchNativeBackend) sizes its decode "
                "gather by host lengths: no CUDA-graph decode path")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode.is_decode:
            batch.attn_metadata = self._decode_metadata(batch)
        else:
            batch.attn_metadata = self._extend_metadata(batch)

    @staticmethod
    def _extend_metadata(batch: ForwardBatch) -> _ExtendMeta:
        table = batch.req_to_token_pool.req_to_token
        slots = [None if prefix == 0 else table[row, :prefix + ext]
                 for row, prefix, ext in zip(batch.req_pool_indices.tolist(),
                                             batch.extend_prefix_lens_cpu,
                                             batch.extend_seq_lens_cpu)]
        starts = [0]
        for ext in batch.extend_seq_lens_cpu:
            starts.append(starts[-1] + ext)
        return _ExtendMeta(slots=slots, starts=starts)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        """q `[T, H, D]` of the new tokens -> `[T, H, D]`; K/V are read from the pool."""
        meta: _ExtendMeta = batch.attn_metadata
        k_buf = batch.kv_pool.k_buffer[layer.layer_id]
        v_buf = batch.kv_pool.v_buffer[layer.layer_id]
        out = torch.empty_like(q)
        for i, slots in enumerate(meta.slots):
            start, end = meta.starts[i], meta.starts[i + 1]
            if slots is None:  # no prefix: its own new tokens
                slots = batch.out_cache_loc[start:end]
            out[start:end] = attend_causal(q[start:end], k_buf[slots], v_buf[slots],
                                           layer.scaling, len(slots) - (end - start))
        return out

    @staticmethod
    def _decode_metadata(batch: ForwardBatch) -> _DecodeGather:
        width = max(batch.seq_lens_cpu)
        table = batch.req_to_token_pool.req_to_token
        slots = table[batch.req_pool_indices, :width]  # [B, L]
        pos = torch.arange(width, device=slots.device)
        slots = slots * (pos[None, :] < batch.seq_lens[:, None])  # padding -> slot 0
        return _DecodeGather(index=head_rows(slots, batch.kv_pool.num_kv_heads),
                             mask=padding_mask(batch.seq_lens, width), width=width)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        """q `[B, H, D]`, one token per request (its K/V already in the pool) -> `[B, H, D]`."""
        meta: _DecodeGather = batch.attn_metadata
        bsz, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // hkv
        lid = layer.layer_id
        k = batch.kv_pool.k_buffer[lid].view(-1, d).index_select(0, meta.index)
        v = batch.kv_pool.v_buffer[lid].view(-1, d).index_select(0, meta.index)
        k = k.view(-1, meta.width, d).to(q.dtype)  # [Hkv * B, L, D]
        v = v.view(-1, meta.width, d).to(q.dtype)
        qh = q.view(bsz, hkv, group, d).transpose(0, 1).reshape(hkv * bsz, group, d)
        out = attend_padded(qh, k, v, meta.mask, layer.scaling)
        return out.view(hkv, bsz, group, d).transpose(0, 1).reshape(bsz, layer.num_heads, d)

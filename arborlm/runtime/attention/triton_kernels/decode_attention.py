"""Paged decode attention in Triton: one query token per request, split-K over the context.

Algorithm (flash-decoding). Stage 1 runs one program per (request, KV head, split): the query
heads that share the KV head are processed together as the rows of one tile (grouped-query
attention without repeating K/V), and the program walks its contiguous chunk of the request's
positions, gathering each position's K/V slot through `req_to_token` (correct for any page
size), with an online softmax in float32. It writes the chunk's normalised output and its
log-sum-exp (base 2). Stage 2 runs one program per (request, query head) and merges the splits
by log-sum-exp.

The number of splits of a request depends on its own length only (`num_kv_splits`), never on the
rest of the batch, so a request's output does not change with batch composition.

This module does not touch the KV pool's contents and knows nothing of `ForwardBatch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from arborlm.runtime.attention.triton_kernels.common import (
    INTERPRET,
    _dot,
    head_block,
    use_f32_dot,
)

LOG2E = 1.4426950408889634
BLOCK_N = 16 if INTERPRET else 64  # positions per tile
SPLIT_CHUNK = 32 if INTERPRET else 256  # a request gets one split per this many positions ...
MAX_KV_SPLITS = 4 if INTERPRET else 32  # ... up to this many


def request_kv_splits(seq_lens: torch.Tensor) -> torch.Tensor:
    """Split count of each request `[B]` int32, from its own length: device ops only, so it
    can run before a CUDA-graph replay without a host sync."""
    return torch.clamp((seq_lens + SPLIT_CHUNK - 1) // SPLIT_CHUNK, 1, MAX_KV_SPLITS).to(
        torch.int32)


def num_kv_splits(seq_lens: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, int]:
    """Per-request split counts `[B]` int32 and the grid size (from the longest sequence).

    A CUDA graph instead launches the fixed grid `MAX_KV_SPLITS`: the programs past a request's
    own split count exit at once, so its output is the same for either grid size.
    """
    grid_splits = min(max(triton.cdiv(max_seq_len, SPLIT_CHUNK), 1), MAX_KV_SPLITS)
    return request_kv_splits(seq_lens), grid_splits


@triton.jit
def _decode_stage1(
    q_ptr, k_ptr, v_ptr, req_to_token_ptr, req_pool_idx_ptr, seq_lens_ptr, num_splits_ptr,
    mid_o_ptr, mid_lse_ptr, sm_scale_log2,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    group, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.load(num_splits_ptr + b)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    row = tl.load(req_pool_idx_ptr + b)
    # Chunk per split, rounded to whole tiles; splits past n_splits get an empty range.
    chunk = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    start = tl.minimum(split * chunk, seq_len)
    end = tl.minimum(start + chunk, seq_len)
    end = tl.where(split < n_splits, end, start)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < group
    mask_d = offs_d < head_dim
    heads = kv_head * group + offs_h  # [BLOCK_H] query heads of this KV head
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(req_to_token_ptr + row * stride_rt + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        qk = _dot(q, tl.trans(k), F32) * sm_scale_log2  # [BLOCK_H, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, F32)
        m_i = m_new

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    store_h = mask_h & (split + offs_h * 0 < n_splits)  # [BLOCK_H]; nothing past n_splits
    tl.store(mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos
             + offs_d[None, :], out, mask=store_h[:, None] & mask_d[None, :])
    tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + split, lse, mask=store_h)


@triton.jit
def _decode_stage2(
    mid_o_ptr, mid_lse_ptr, num_splits_ptr, o_ptr,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    head_dim, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    n_splits = tl.load(num_splits_ptr + b)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    o_base = mid_o_ptr + b * stride_mob + head * stride_moh + offs_d
    lse_base = mid_lse_ptr + b * stride_mlb + head * stride_mlh
    # Split 0 always starts at position 0, so it is never empty: start the merge from it.
    m_i = tl.load(lse_base)
    l_i = tl.full([], 1.0, tl.float32)
    acc = tl.load(o_base, mask=mask_d, other=0.0)  # [BLOCK_D]
    for s in range(1, n_splits):
        lse = tl.load(lse_base + s)
        o = tl.load(o_base + s * stride_mos, mask=mask_d, other=0.0)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)  # 0 for an empty split (lse = -inf)
        acc = acc * alpha + w * o
        l_i = l_i * alpha + w
        m_i = m_new
    tl.store(o_ptr + b * stride_ob + head * stride_oh + offs_d,
             (acc / l_i).to(o_ptr.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, kv_splits: torch.Tensor, grid_splits: int,
                     sm_scale: float,
                     scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of one new token per request over its whole cached sequence.

    q `[B, H, D]`; k/v_buffer `[num_slots, Hkv, D]`; req_to_token `[rows, max_len]` int64;
    req_pool_indices, seq_lens `[B]`; kv_splits `[B]` int32 and grid_splits from
    `num_kv_splits`. `scratch` (mid_o `[B, H, grid_splits, D]`, mid_lse `[B, H, grid_splits]`,
    float32) holds the per-split partial results; without it they are allocated per call.
    Returns `[B, H, D]` in q's dtype.
    """
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    block_d = head_block(head_dim)
    block_h = max(16, triton.next_power_of_2(group))  # query-head rows per tile
    if scratch is None:
        mid_o = torch.empty((bsz, num_heads, grid_splits, head_dim), dtype=torch.float32,
                            device=q.device)  # [B, H, S, D]
        mid_lse = torch.empty((bsz, num_heads, grid_splits), dtype=torch.float32,
                              device=q.device)  # [B, H, S]
    else:
        mid_o, mid_lse = scratch
        assert mid_o.shape == (bsz, num_heads, grid_splits, head_dim), "scratch mid_o shape"
        assert mid_lse.shape == (bsz, num_heads, grid_splits), "scratch mid_lse shape"
        assert mid_o.stride(3) == 1, "scratch mid_o must be contiguous in head_dim"
    out = torch.empty((bsz, num_heads, head_dim), dtype=q.dtype, device=q.device)
    _decode_stage1[(bsz, num_kv_heads, grid_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, kv_splits,
        mid_o, mid_lse, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        group, head_dim,
        BLOCK_H=block_h, BLOCK_N=BLOCK_N, BLOCK_D=block_d, F32=use_f32_dot(q.dtype),
        num_warps=4,
    )
    _decode_stage2[(bsz, num_heads)](
        mid_o, mid_lse, kv_splits, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), head_dim,
        BLOCK_D=block_d, num_warps=4,
    )
    return out

"""Paged extend (prefill) attention in Triton: new tokens over a cached prefix plus themselves.

Algorithm (flash attention, forward only). One program per (request, query head, tile of
BLOCK_M new tokens). It keeps a running max, sum and float32 accumulator (online softmax) while
it walks two ranges of key positions, gathering each position's K/V slot through
`req_to_token` (correct for any page size):

(a) the cached prefix `[0, prefix_len)`, which every new token sees in full — no mask;
(b) the new tokens `[prefix_len, prefix_len + extend_len)`, up to the tile's last row, under a
    causal mask (new token i sees new tokens 0..i).

Both ranges read the KV pool: the backend writes the new tokens' K/V there before the kernel
runs. The query rows of request b are `q[q_start[b] : q_start[b] + extend_len[b]]`.

This module knows nothing of `ForwardBatch` and never writes the KV pool.
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
BLOCK_M = 16 if INTERPRET else 64  # new tokens (query rows) per program
BLOCK_N = 16 if INTERPRET else 64  # key positions per tile


@triton.jit
def _softmax_step(q, k_ptrs, v_ptrs, kv_mask, score_mask, m_i, l_i, acc, sm_scale_log2,
                  F32: tl.constexpr):
    """One online-softmax update of (m_i, l_i, acc) with a tile of K/V."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
    qk = _dot(q, tl.trans(k), F32) * sm_scale_log2  # [BLOCK_M, BLOCK_N]
    qk = tl.where(score_mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, F32)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr, o_ptr, k_ptr, v_ptr, req_to_token_ptr, req_pool_idx_ptr,
    prefix_lens_ptr, extend_lens_ptr, q_start_ptr, sm_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_rt, group, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // group
    extend_len = tl.load(extend_lens_ptr + b)
    prefix_len = tl.load(prefix_lens_ptr + b)
    q_start = tl.load(q_start_ptr + b)
    row_base = req_to_token_ptr + tl.load(req_pool_idx_ptr + b) * stride_rt

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among new tokens
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < head_dim
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :],
                other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # A tile past this request's new tokens has nothing to compute: give it empty ranges.
    live = m_block * BLOCK_M < extend_len
    prefix_end = tl.where(live, prefix_len, 0)
    new_end = tl.where(live, tl.minimum(extend_len, (m_block + 1) * BLOCK_M), 0)

    for start_n in range(0, prefix_end, BLOCK_N):  # (a) cached prefix, no mask
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_end
        slots = tl.load(row_base + offs_n, mask=mask_n, other=0)  # [BLOCK_N]
        m_i, l_i, acc = _softmax_step(
            q, k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask_n[:, None] & mask_d[None, :], mask_n[None, :], m_i, l_i, acc,
            sm_scale_log2, F32)

    for start_n in range(0, new_end, BLOCK_N):  # (b) new tokens, causal
        offs_n = start_n + tl.arange(0, BLOCK_N)  # index among new tokens
        mask_n = offs_n < new_end
        slots = tl.load(row_base + prefix_len + offs_n, mask=mask_n, other=0)  # [BLOCK_N]
        causal = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _softmax_step(
            q, k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask_n[:, None] & mask_d[None, :], causal, m_i, l_i, acc, sm_scale_log2, F32)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     q_start: torch.Tensor, max_extend_len: int, sm_scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves.

    q `[T, H, D]` (the requests' new tokens, concatenated in batch order); k/v_buffer
    `[num_slots, Hkv, D]` already holding the new tokens' K/V; req_to_token `[rows, max_len]`
    int64; req_pool_indices `[B]`; prefix_lens, extend_lens, q_start `[B]` int32 (q_start is
    the exclusive cumulative sum of extend_lens). Returns `[T, H, D]` in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    block_d = head_block(head_dim)
    # Wide heads need smaller tiles to fit in registers/shared memory.
    block_m, block_n = (BLOCK_M, BLOCK_N) if block_d <= 128 else (32, 32)
    grid = (len(extend_lens), num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, out, k_buffer, v_buffer, req_to_token, req_pool_indices,
        prefix_lens, extend_lens, q_start, sm_scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), group, head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, F32=use_f32_dot(q.dtype),
        num_warps=4 if block_d <= 64 else 8,
    )
    return out

"""Random paged batches for the attention tests, built the way the scheduler builds them.

Requests get rows of a `ReqToTokenPool` in scrambled order and KV slots from a
`PagedAllocator`, handed out round-robin in small pieces so that a request's slots are not
contiguous (page-contiguous only within a page when page size > 1). Every KV slot, the padding
slot 0 included, holds random values, so a kernel that reads a slot it should not is caught.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from arborlm.runtime.attention.base import AttentionBackend, AttentionLayerSpec
from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
from arborlm.runtime.memory_pool import KVPool, PagedAllocator, ReqToTokenPool

DEVICE = os.environ.get("ARBORLM_TEST_DEVICE", "cpu")
NUM_LAYERS = 2
LAYER_ID = 1  # the second layer, so a kernel that ignores layer_id reads the wrong buffer

# (atol, rtol) per dtype for attention outputs of unit-variance inputs. Half-precision kernels
# round the softmax weights to the input dtype before the P @ V product (as flash attention
# does), so a dominant weight near 1 carries a relative error of 2**-9 (bf16) / 2**-12 (fp16),
# plus the rounding of the output itself: a few units in the last place of values up to ~4.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class Case:
    batch: ForwardBatch
    layer: AttentionLayerSpec
    q: torch.Tensor  # [T, H*D]
    k: torch.Tensor  # [T, Hkv*D]
    v: torch.Tensor  # [T, Hkv*D]


def _allocate(alloc: PagedAllocator, rtt: ReqToTokenPool, rows: list[int], ends: list[int],
              gen: torch.Generator) -> None:
    """Give every request slots for positions up to `ends`, a few at a time, round-robin."""
    done = [0] * len(rows)
    last = [0] * len(rows)
    while any(d < e for d, e in zip(done, ends)):
        for i, row in enumerate(rows):
            if done[i] >= ends[i]:
                continue
            step = int(torch.randint(1, 7, (1,), generator=gen))
            end = min(done[i] + step, ends[i])
            slots = alloc.alloc_range(done[i], end, last[i])
            rtt.write(row, done[i], slots.to(rtt.req_to_token.device))
            last[i] = int(slots[-1])
            done[i] = end


def make_case(prefix_lens: list[int], extend_lens: list[int], num_heads: int, num_kv_heads: int,
              head_dim: int, page_size: int, dtype: torch.dtype, decode: bool = False,
              seed: int = 0, fused_qkv: bool = False) -> Case:
    """A batch whose request i has `prefix_lens[i]` cached tokens and `extend_lens[i]` new ones.

    With `decode`, every extend length must be 1 and the batch is in DECODE mode. With
    `fused_qkv`, q/k/v are column slices of one `[T, (H + 2*Hkv)*D]` tensor (non-contiguous rows,
    as a fused QKV projection produces them).
    """
    assert not decode or all(e == 1 for e in extend_lens)
    gen = torch.Generator().manual_seed(seed)
    bsz = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages = sum(math.ceil(s / page_size) for s in seq_lens) + 2
    alloc = PagedAllocator(pages * page_size, page_size)
    rtt = ReqToTokenPool(bsz + 3, max(seq_lens) + 5, device=DEVICE)
    rows = torch.randperm(bsz + 3, generator=gen)[:bsz].tolist()
    _allocate(alloc, rtt, rows, prefix_lens, gen)
    new_slots = []
    for row, p, e in zip(rows, prefix_lens, extend_lens):
        last = int(rtt.req_to_token[row, p - 1]) if p else 0
        slots = alloc.alloc_range(p, p + e, last)
        rtt.write(row, p, slots.to(DEVICE))
        new_slots.append(slots)

    pool = KVPool(pages * page_size, NUM_LAYERS, num_kv_heads, head_dim, dtype, device=DEVICE)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    tokens = sum(extend_lens)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype=dtype, device=DEVICE)
    if not fused_qkv:
        qkv = qkv.clone()
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=1)
    if not fused_qkv:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    loc = torch.cat(new_slots).to(DEVICE)
    pool.set_kv(LAYER_ID, loc, k.reshape(tokens, num_kv_heads, head_dim),
                v.reshape(tokens, num_kv_heads, head_dim))  # as the layer's forward will

    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        batch_size=bsz,
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=DEVICE),
        positions=positions.to(DEVICE),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE),
        out_cache_loc=loc,
        req_to_token_pool=rtt,
        kv_pool=pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=[] if decode else list(prefix_lens),
        extend_seq_lens_cpu=[] if decode else list(extend_lens),
    )
    layer = AttentionLayerSpec(layer_id=LAYER_ID, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim,
                               scaling=head_dim ** -0.5)
    return Case(batch=batch, layer=layer, q=q, k=k, v=v)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu().reshape(actual.shape),
                               atol=atol, rtol=rtol)


def run_backend(backend: AttentionBackend, case: Case) -> torch.Tensor:
    """One attention layer of `case` through `backend`: `[T, H*D]`."""
    backend.init_forward_metadata(case.batch)
    return backend.forward(case.q, case.k, case.v, case.layer, case.batch)


def dense_reference(case: Case) -> torch.Tensor:
    """Float64 attention straight from the definition, request by request: `[T, H, D]`."""
    b = case.batch
    layer = case.layer
    group = layer.num_heads // layer.num_kv_heads
    k_buf = b.kv_pool.k_buffer[layer.layer_id]
    v_buf = b.kv_pool.v_buffer[layer.layer_id]
    q = case.q.reshape(-1, layer.num_heads, layer.head_dim).double()
    ext = [1] * b.batch_size if b.mode.is_decode else b.extend_seq_lens_cpu
    outs, start = [], 0
    for row, seq, e in zip(b.req_pool_indices.tolist(), b.seq_lens_cpu, ext):
        slots = b.req_to_token_pool.req_to_token[row, :seq]
        k = k_buf[slots].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_buf[slots].double().repeat_interleave(group, dim=1)
        qi = q[start:start + e]  # [e, H, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * layer.scaling  # [H, e, S]
        q_pos = torch.arange(seq - e, seq, device=scores.device)[:, None]
        allowed = torch.arange(seq, device=scores.device)[None, :] <= q_pos  # [e, S]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += e
    return torch.cat(outs)

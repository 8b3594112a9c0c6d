"""The Triton decode and extend kernels against attention computed from its definition.

Runs in Triton's CPU interpreter by default (conftest sets `TRITON_INTERPRET=1`), or compiled on
a GPU with `ARBORLM_TEST_DEVICE=cuda`. The reference is float64 attention over K/V gathered
through `req_to_token`, so these tests pin the kernels' own edge cases: split-K boundaries
(including a trailing empty split), requests of length 1, tiles that straddle the prefix / new
token boundary, head sizes that are not a power of two, strided query rows, and batch
invariance.
"""

from __future__ import annotations

import pytest
import torch
import triton

from arborlm.runtime.attention.triton_kernels import (
    INTERPRET,
    decode_attention_fwd,
    extend_attention_fwd,
    num_kv_splits,
)
from arborlm.runtime.attention.triton_kernels import decode_attention as decode_mod
from arborlm.runtime.attention.triton_kernels import extend_attention as extend_mod
from tests.runtime.attention.batches import (
    DEVICE,
    Case,
    assert_close,
    dense_reference,
    make_case,
)

pytestmark = pytest.mark.triton_interpret

if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("Triton kernels were imported without TRITON_INTERPRET=1; on CPU they only run "
                "in the interpreter", allow_module_level=True)

CHUNK = decode_mod.SPLIT_CHUNK
MAX_SPLITS = decode_mod.MAX_KV_SPLITS


def _decode(case: Case) -> torch.Tensor:
    b, layer = case.batch, case.layer
    splits, grid = num_kv_splits(b.seq_lens, max(b.seq_lens_cpu))
    q = case.q.reshape(-1, layer.num_heads, layer.head_dim)
    return decode_attention_fwd(q, b.kv_pool.k_buffer[layer.layer_id],
                            b.kv_pool.v_buffer[layer.layer_id], b.req_to_token_pool.req_to_token,
                            b.req_pool_indices, b.seq_lens, splits, grid, layer.scaling)


def _extend(case: Case) -> torch.Tensor:
    b, layer = case.batch, case.layer
    ext = b.extend_seq_lens_cpu
    starts = [sum(ext[:i]) for i in range(len(ext))]
    lens = torch.tensor([b.extend_prefix_lens_cpu, ext, starts], dtype=torch.int32,
                        device=DEVICE)
    q = case.q.reshape(-1, layer.num_heads, layer.head_dim)
    return extend_attention_fwd(q, b.kv_pool.k_buffer[layer.layer_id],
                            b.kv_pool.v_buffer[layer.layer_id], b.req_to_token_pool.req_to_token,
                            b.req_pool_indices, lens[0], lens[1], lens[2], max(ext),
                            layer.scaling)


def _has_empty_split(seq_len: int) -> bool:
    n = min(triton.cdiv(seq_len, CHUNK), MAX_SPLITS)
    chunk = triton.cdiv(triton.cdiv(seq_len, n), decode_mod.BLOCK_N) * decode_mod.BLOCK_N
    return (n - 1) * chunk >= seq_len


def test_num_kv_splits_follow_each_requests_own_length():
    seq_lens = torch.tensor([1, CHUNK, CHUNK + 1, 3 * CHUNK, 100 * CHUNK], device=DEVICE)
    splits, grid = num_kv_splits(seq_lens, 3 * CHUNK)
    assert splits.dtype == torch.int32
    assert splits.tolist() == [1, 1, 2, min(3, MAX_SPLITS), MAX_SPLITS]
    assert grid == min(3, MAX_SPLITS)  # from the max length passed in, not from the tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_boundaries(dtype):
    """Lengths at and around split and tile boundaries, clamped split counts, length 1."""
    lens = [1, CHUNK, CHUNK + 1, 2 * CHUNK + 3, MAX_SPLITS * CHUNK + 5]
    case = make_case([n - 1 for n in lens], [1] * len(lens), 4, 2, 32, 1, dtype, decode=True,
                     seed=1)
    assert_close(_decode(case), dense_reference(case), dtype)


def test_decode_trailing_empty_split():
    """A length whose tile-rounded chunks leave the last split empty must still merge right."""
    seq_len = next((n for n in range(1, 4 * MAX_SPLITS * CHUNK) if _has_empty_split(n)), None)
    if seq_len is None:
        pytest.skip("these block sizes never leave an empty split")
    case = make_case([seq_len - 1, 4], [1, 1], 2, 1, 32, 1, torch.float32, decode=True, seed=2)
    assert_close(_decode(case), dense_reference(case), torch.float32)


def test_decode_is_batch_invariant():
    """A request's output is bit-identical alone and next to a much longer request."""
    alone = make_case([20], [1], 4, 2, 32, 4, torch.float32, decode=True, seed=3)
    out_alone = _decode(alone)
    mixed = make_case([20, MAX_SPLITS * CHUNK], [1, 1], 4, 2, 32, 4, torch.float32,
                      decode=True, seed=3)
    # Give request 0 of the mixed batch exactly the same K/V and query as the lone request.
    layer = alone.layer.layer_id
    src = alone.batch.req_to_token_pool.req_to_token[alone.batch.req_pool_indices[0], :21]
    dst = mixed.batch.req_to_token_pool.req_to_token[mixed.batch.req_pool_indices[0], :21]
    mixed.batch.kv_pool.k_buffer[layer][dst] = alone.batch.kv_pool.k_buffer[layer][src]
    mixed.batch.kv_pool.v_buffer[layer][dst] = alone.batch.kv_pool.v_buffer[layer][src]
    mixed.q[0] = alone.q[0]
    assert torch.equal(_decode(mixed)[0], out_alone[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_tiles_and_prefixes(dtype):
    """New-token tiles straddling BLOCK_M, prefix 0, one new token on a long prefix."""
    block_m = extend_mod.BLOCK_M
    prefix = [0, 5, 3 * block_m + 1, block_m]
    extend = [2 * block_m + 3, block_m, 1, block_m - 1]
    case = make_case(prefix, extend, 4, 2, 32, 4, dtype, seed=4)
    assert_close(_extend(case), dense_reference(case), dtype)


def test_odd_head_dim_and_group():
    """Head size 48 (padded tile) and 3 query heads per KV head (padded head rows)."""
    ext = make_case([7, 0], [9, 12], 6, 2, 48, 1, torch.float32, seed=5)
    assert_close(_extend(ext), dense_reference(ext), torch.float32)
    dec = make_case([7, 40], [1, 1], 6, 2, 48, 1, torch.float32, decode=True, seed=5)
    assert_close(_decode(dec), dense_reference(dec), torch.float32)


def test_strided_query_rows():
    """q as a column slice of a fused QKV projection: rows are not contiguous."""
    ext = make_case([6, 0], [10, 5], 4, 2, 32, 1, torch.float32, seed=6, fused_qkv=True)
    assert not ext.q.is_contiguous()
    assert_close(_extend(ext), dense_reference(ext), torch.float32)
    dec = make_case([6, 30], [1, 1], 4, 2, 32, 1, torch.float32, decode=True, seed=6,
                    fused_qkv=True)
    assert_close(_decode(dec), dense_reference(dec), torch.float32)

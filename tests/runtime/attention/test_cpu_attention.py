"""The CPU attention backend (`torch_native` on a CPU) against a float64 attention computed from
the definition.

Extend steps with and without cached prefixes, decode steps over scattered slots, and decode
batches whose requests share a cached prefix (same KV slots, as the radix cache hands them out),
which take the cascade path: the prefix's K/V read once for the whole batch; and two
consecutive decode steps, the second appending to the decode workspace. Every test runs twice:
with ArborLM's CPU decode-attention kernel (`cpu_kernels.decode_attention`) and with the
batched-matmul path that serves where it cannot run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from arborlm.runtime.platforms.cpu import cascade as cpu_cascade
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.attention import CpuAttentionBackend
from tests.runtime.attention.batches import (
    assert_close,
    dense_reference,
    make_case,
    run_backend,
)

LAYOUTS = {"mha": (2, 2, 32), "gqa2": (4, 2, 64), "gqa4": (8, 2, 32), "mqa": (3, 1, 64)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, params=["kernel", "matmuls"])
def decode_path(request, monkeypatch):
    """Decode attention with the CPU kernel, or with batched matmuls (the kernel turned off)."""
    if request.param == "kernel":
        if not cpu_kernels.attention_available(torch.float32):
            pytest.skip("ArborLM's CPU kernels do not run on this machine")
    else:
        monkeypatch.setattr(cpu_kernels, "attention_available", lambda dtype: False)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
def test_matches_dense_reference(layout, dtype, decode, decode_path):
    heads, kv_heads, head_dim = LAYOUTS[layout]
    if decode:
        prefix, extend = [0, 5, 40, 17], [1, 1, 1, 1]
    else:
        prefix, extend = [0, 5, 40, 0], [7, 1, 9, 30]
    case = make_case(prefix, extend, heads, kv_heads, head_dim, 1, dtype, decode=decode,
                     seed=len(layout), fused_qkv=True)
    assert_close(run_backend(CpuAttentionBackend(), case), dense_reference(case).to(dtype), dtype)
    if decode:
        assert case.batch.attn_metadata.kernel == (decode_path == "kernel")


def _share_prefix(case, shared: int, members: list[int] | None = None) -> None:
    """Point the first `shared` positions of `members` (default: every request) at the first
    member's slots, as the radix cache hands out a cached prefix."""
    b = case.batch
    table = b.req_to_token_pool.req_to_token
    rows = b.req_pool_indices.tolist()
    members = list(range(len(rows))) if members is None else members
    for i in members[1:]:
        table[rows[i], :shared] = table[rows[members[0]], :shared]


def _earlier_step(case, back: int, seed: int, keep: list[int] | None = None):
    """The decode step `back` tokens before `case` (0: `case` itself) of the requests at
    `keep` (default all), with its own random q/k/v; for the workspace tests."""
    b = case.batch
    keep = list(range(b.batch_size)) if keep is None else keep
    idx = torch.tensor(keep)
    table = b.req_to_token_pool.req_to_token
    lens = [b.seq_lens_cpu[i] - back for i in keep]
    seq_lens = torch.tensor(lens)
    rows = b.req_pool_indices[idx]
    layer = case.layer
    qkv = make_case([n - 1 for n in lens], [1] * len(lens), layer.num_heads, layer.num_kv_heads,
                    layer.head_dim, 1, case.q.dtype, decode=True, seed=seed)
    step = dataclasses.replace(b, batch_size=len(keep), req_pool_indices=rows, seq_lens=seq_lens,
                               seq_lens_cpu=lens, out_cache_loc=table[rows, seq_lens - 1],
                               input_ids=b.input_ids[idx], positions=seq_lens - 1)
    return dataclasses.replace(case, batch=step, q=qkv.q, k=qkv.k, v=qkv.v)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", ["gqa2", "mqa"])
def test_cascade_decode_over_a_shared_prefix(layout, dtype, monkeypatch):
    heads, kv_heads, head_dim = LAYOUTS[layout]
    monkeypatch.setattr(cpu_cascade, "CASCADE_MIN_PREFIX", 8)
    case = make_case([20, 31, 12, 25], [1] * 4, heads, kv_heads, head_dim, 1, dtype,
                     decode=True, seed=3)
    _share_prefix(case, 10)
    backend = CpuAttentionBackend()
    out = run_backend(backend, case)
    cascade = case.batch.attn_metadata.cascade
    assert cascade.width == 10
    assert cascade.identity  # one group of the whole batch, in order: no reordering
    assert_close(out, dense_reference(case).to(dtype), dtype)


def test_no_cascade_below_the_threshold_or_alone():
    case = make_case([20, 31], [1, 1], 4, 2, 64, 1, torch.float32, decode=True, seed=4)
    _share_prefix(case, 10)
    run_backend(CpuAttentionBackend(), case)
    assert case.batch.attn_metadata.cascade is None  # 10 < CASCADE_MIN_PREFIX
    assert_close(run_backend(CpuAttentionBackend(), case), dense_reference(case), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", ["gqa2", "gqa4"])
def test_cascade_decode_over_several_groups(layout, dtype, monkeypatch, decode_path):
    """Two groups with prefixes of different lengths and sizes, and two requests in none."""
    heads, kv_heads, head_dim = LAYOUTS[layout]
    monkeypatch.setattr(cpu_cascade, "CASCADE_MIN_PREFIX", 8)
    case = make_case([20, 31, 12, 25, 40, 9, 33], [1] * 7, heads, kv_heads, head_dim, 1, dtype,
                     decode=True, seed=9)
    _share_prefix(case, 11, [0, 2, 3])
    _share_prefix(case, 24, [4, 1, 6])
    out = run_backend(CpuAttentionBackend(), case)
    cascade = case.batch.attn_metadata.cascade
    assert (cascade.num_groups, cascade.max_members, cascade.width) == (2, 3, 24)
    assert not cascade.identity
    assert case.batch.attn_metadata.kernel == (decode_path == "kernel")
    assert_close(out, dense_reference(case).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", ["gqa2", "mha", "mqa"])
def test_cascade_extend_over_shared_prefixes(layout, dtype, monkeypatch, decode_path):
    """An extend batch with two groups on cached prefixes (one member's prefix longer than the
    shared part), a request on an unshared prefix and a fresh prompt: each group's prefix is
    attended once for all its members (by `cpu_kernels.prefix_attention` where the kernels run,
    else ATen's flash kernel), and every row matches the reference."""
    heads, kv_heads, head_dim = LAYOUTS[layout]
    monkeypatch.setattr(cpu_cascade, "CASCADE_MIN_PREFIX", 8)
    prefix_calls = []
    prefix_attention = cpu_kernels.prefix_attention
    monkeypatch.setattr(cpu_kernels, "prefix_attention",
                        lambda *args: prefix_calls.append(args[0].shape[0])
                        or prefix_attention(*args))
    case = make_case([20, 31, 12, 25, 40, 9, 0], [5, 1, 7, 3, 4, 6, 8], heads, kv_heads,
                     head_dim, 1, dtype, seed=21)
    _share_prefix(case, 12, [0, 1, 2])  # member 1's prefix runs 19 tokens past the shared 12
    _share_prefix(case, 24, [4, 3])
    out = run_backend(CpuAttentionBackend(), case)
    groups = case.batch.attn_metadata.groups
    assert sorted((g.members, g.slots.numel()) for g in groups) == [([0, 1, 2], 12),
                                                                     ([3, 4], 24)]
    # The new tokens of each group's members, once per group.
    assert sorted(prefix_calls) == ([3 + 4, 5 + 1 + 7] if decode_path == "kernel" else [])
    assert_close(out, dense_reference(case).to(dtype), dtype)


def test_long_extends_attend_alone(monkeypatch):
    """A member with more than CASCADE_EXTEND_MAX_NEW new tokens leaves its group."""
    monkeypatch.setattr(cpu_cascade, "CASCADE_MIN_PREFIX", 8)
    monkeypatch.setattr(cpu_cascade, "CASCADE_EXTEND_MAX_NEW", 6)
    case = make_case([20, 31, 12], [5, 1, 7], 4, 2, 64, 1, torch.float32, seed=22)
    _share_prefix(case, 12)
    out = run_backend(CpuAttentionBackend(), case)
    assert [g.members for g in case.batch.attn_metadata.groups] == [[0, 1]]
    assert_close(out, dense_reference(case), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_cascade_groups_in_the_workspace(dtype, monkeypatch):
    """Fill, append, then a member of each group leaves: the prefixes stay in the workspace,
    the others' own keys are kept, and every step matches the reference."""
    heads, kv_heads, head_dim = LAYOUTS["gqa2"]
    monkeypatch.setattr(cpu_cascade, "CASCADE_MIN_PREFIX", 8)
    case = make_case([30, 22, 41, 17, 28], [1] * 5, heads, kv_heads, head_dim, 1, dtype,
                     decode=True, seed=10)
    _share_prefix(case, 12, [0, 1, 2])
    _share_prefix(case, 10, [3, 4])
    backend = CpuAttentionBackend()
    steps = [_earlier_step(case, 2, seed=11), _earlier_step(case, 1, seed=12),
             _earlier_step(case, 0, seed=13, keep=[0, 2, 4])]
    for step, kind in zip(steps, ["fill", "append", "append"]):
        out = run_backend(backend, step)
        assert step.batch.attn_metadata.workspace == kind
        assert step.batch.attn_metadata.cascade is not None
        assert_close(out, dense_reference(step).to(dtype), dtype)
    assert steps[0].batch.attn_metadata.cascade.num_groups == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", ["gqa2", "mqa"])
def test_decode_workspace_fill_then_append(layout, dtype):
    """Two consecutive decode steps of one backend: the second appends to the workspace."""
    heads, kv_heads, head_dim = LAYOUTS[layout]
    case = make_case([20, 31, 12, 7], [1] * 4, heads, kv_heads, head_dim, 1, dtype,
                     decode=True, seed=5)
    b = case.batch
    rows = b.req_pool_indices
    table = b.req_to_token_pool.req_to_token
    first = make_case([19, 30, 11, 6], [1] * 4, heads, kv_heads, head_dim, 1, dtype,
                      decode=True, seed=6)  # its q/k/v play the previous step's
    prev = dataclasses.replace(b, seq_lens=b.seq_lens - 1,
                               seq_lens_cpu=[n - 1 for n in b.seq_lens_cpu],
                               out_cache_loc=table[rows, b.seq_lens - 2])
    backend = CpuAttentionBackend()
    step1 = dataclasses.replace(case, batch=prev, q=first.q, k=first.k, v=first.v)
    assert_close(run_backend(backend, step1), dense_reference(step1).to(dtype), dtype)
    assert prev.attn_metadata.workspace == "fill"
    out = run_backend(backend, case)
    assert b.attn_metadata.workspace == "append"
    assert_close(out, dense_reference(case).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_decode_workspace_drops_requests_that_left(dtype):
    """A request leaving between two decode steps: the others' rows are kept and appended to."""
    heads, kv_heads, head_dim = LAYOUTS["gqa2"]
    case = make_case([20, 31, 12, 7], [1] * 4, heads, kv_heads, head_dim, 1, dtype,
                     decode=True, seed=7)
    b = case.batch
    table = b.req_to_token_pool.req_to_token
    first = make_case([19, 30, 11, 6], [1] * 4, heads, kv_heads, head_dim, 1, dtype,
                      decode=True, seed=8)
    prev = dataclasses.replace(b, seq_lens=b.seq_lens - 1,
                               seq_lens_cpu=[n - 1 for n in b.seq_lens_cpu],
                               out_cache_loc=table[b.req_pool_indices, b.seq_lens - 2])
    backend = CpuAttentionBackend()
    run_backend(backend, dataclasses.replace(case, batch=prev, q=first.q, k=first.k, v=first.v))
    keep = torch.tensor([0, 2, 3])  # request 1 finished
    rest = dataclasses.replace(
        b, batch_size=3, req_pool_indices=b.req_pool_indices[keep], seq_lens=b.seq_lens[keep],
        seq_lens_cpu=[b.seq_lens_cpu[i] for i in keep.tolist()],
        out_cache_loc=b.out_cache_loc[keep], input_ids=b.input_ids[keep],
        positions=b.positions[keep])
    step2 = dataclasses.replace(case, batch=rest, q=case.q[keep], k=case.k[keep],
                                v=case.v[keep])
    out = run_backend(backend, step2)
    assert rest.attn_metadata.workspace == "append"
    assert_close(out, dense_reference(step2).to(dtype), dtype)


def test_decode_without_room_for_the_workspace(monkeypatch):
    """Over the workspace's byte limit a decode step gathers from the pool, as exactly; the
    limit itself lies between `MIN_BYTES` and the pool's size."""
    from arborlm.runtime.platforms.cpu import decode_workspace

    case = make_case([20, 31, 12, 7], [1] * 4, 4, 2, 64, 1, torch.float32, decode=True, seed=14)
    pool = case.batch.kv_pool
    pool_bytes = 2 * pool.num_layers * pool.num_slots * pool.num_kv_heads * pool.head_dim * 4
    assert decode_workspace.byte_limit(pool) == max(decode_workspace.MIN_BYTES, pool_bytes)
    monkeypatch.setattr(decode_workspace, "byte_limit", lambda pool: 0)
    out = run_backend(CpuAttentionBackend(), case)
    assert case.batch.attn_metadata.workspace is None
    assert_close(out, dense_reference(case), torch.float32)

"""`arborlm::decode_attention`, ArborLM's CPU decode-attention kernel, against float64 attention
computed from the definition.

Head shapes cover the specialized ones (G query heads per KV head from 1 to 8, head dim
64/128) and the general path (G = 3 at head dim 32, G = 12, head dims 16 and 80); key counts
cover the 16-wide tails of the softmax, a single key, no key (zero output, -inf log-sum-exp)
and rows that use all W keys; keys are strided views of a larger buffer, as the decode
workspace hands them out; one and two threads; a traced call inside `torch.compile`; and the
errors on bad arguments. float32 must agree with float64 to float32 rounding; bfloat16 (inputs
widened exactly, float32 sums) within one bfloat16 rounding of the output.
`decode_attention_paged`, the same arithmetic reading the keys from a paged pool through
scattered slot tables, must equal the kernel run on the gathered keys bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

DTYPES = [torch.float32, torch.bfloat16]
# (KV heads, requests, query heads per KV head, head dim, keys W)
SHAPES = [(4, 3, 2, 64, 37), (2, 5, 4, 128, 100), (1, 1, 1, 64, 1), (2, 2, 8, 64, 16),
          (3, 4, 3, 32, 50), (1, 2, 2, 16, 33), (2, 3, 1, 80, 20), (1, 6, 2, 128, 300),
          (4, 3, 3, 64, 45), (1, 2, 6, 128, 70), (2, 2, 5, 64, 19), (1, 3, 7, 64, 25),
          (1, 2, 12, 64, 40)]


@pytest.fixture(autouse=True)
def kernels_or_skip():
    if not capabilities.kernel_instructions(torch.float32):
        pytest.skip("this CPU lacks AVX-512, which decode_attention needs")
    assert cpu_kernels.attention_available(torch.float32), "the CPU supports it but no build"


def _reference(q, k, v, lens, scale):
    """float64 output `[N, G, D]` and log-sum-exp `[N, G]` of the definition."""
    rows, _, _ = q.shape
    width = k.shape[1]
    scores = torch.einsum("ngd,nwd->ngw", q.double(), k.double()) * scale
    per_row = lens.repeat(rows // lens.numel())  # row n is request n % B
    past = torch.arange(width)[None, :] >= per_row[:, None]  # [N, W]
    scores = scores.masked_fill(past[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys: all zero
    return torch.einsum("ngw,nwd->ngd", probs, v.double()), lse


def _case(shape, dtype, gen, pad=5):
    hkv, bsz, group, dim, width = shape
    kbuf = torch.randn(hkv * bsz, width + pad, dim, generator=gen).to(dtype)
    vbuf = torch.randn(hkv * bsz, width + pad, dim, generator=gen).to(dtype)
    q = torch.randn(hkv * bsz, group, dim, generator=gen).to(dtype)
    lens = torch.randint(1, width + 1, (bsz,), generator=gen)
    lens[0] = width
    return q, kbuf[:, :width], vbuf[:, :width], lens  # strided keys, as the workspace's view


def _check(out, lse, q, k, v, lens, scale):
    ref, ref_lse = _reference(q, k, v, lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert torch.allclose(lse.double()[~empty], ref_lse[~empty], rtol=1e-6, atol=1e-5)
    # Weighted means of values with |v| <~ 4: float32 ~1e-6; bfloat16 one output rounding.
    tol = 2e-5 if q.dtype == torch.float32 else 2.0 ** -8 * ref.abs() + 1e-5
    assert bool(((out.double() - ref).abs() <= tol).all()), \
        f"max error {(out.double() - ref).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64(dtype, threads, torch_threads):
    gen = torch.Generator().manual_seed(0)
    torch_threads(threads)
    for shape in SHAPES:
        q, k, v, lens = _case(shape, dtype, gen)
        scale = shape[3] ** -0.5
        out, lse = cpu_kernels.decode_attention(q, k, v, lens, scale)
        _check(out, lse, q, k, v, lens, scale)


def test_rows_without_keys_give_zero_and_minus_infinity():
    gen = torch.Generator().manual_seed(1)
    q, k, v, _ = _case((2, 3, 2, 64, 12), torch.float32, gen)
    lens = torch.tensor([0, 12, 5])
    out, lse = cpu_kernels.decode_attention(q, k, v, lens, 0.125)
    rows_without = [0, 3]  # request 0 under both KV heads
    assert torch.equal(out[rows_without], torch.zeros_like(out[rows_without]))
    assert bool(torch.isneginf(lse[rows_without]).all())
    _check(out, lse, q, k, v, lens, 0.125)


def test_traced_call():
    gen = torch.Generator().manual_seed(2)
    q, k, v, lens = _case((2, 4, 2, 64, 40), torch.float32, gen)

    def fn(q, k, v, lens):
        out, lse = cpu_kernels.decode_attention(q * 2, k, v, lens, 0.125)
        return out + 1, lse

    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    with torch.inference_mode():
        got, want = compiled(q, k, v, lens), fn(q, k, v, lens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_arguments_name_the_problem():
    q, k = torch.randn(4, 2, 64), torch.randn(4, 10, 64)
    lens = torch.tensor([3, 10])
    with pytest.raises(RuntimeError, match=r"q \[N, G, D\]"):
        cpu_kernels.decode_attention(q[0], k, k, lens, 1.0)
    with pytest.raises(RuntimeError, match="k and v must be"):
        cpu_kernels.decode_attention(q, k[:3], k[:3], lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.decode_attention(q[..., :40], k[..., :40], k[..., :40], lens, 1.0)
    with pytest.raises(RuntimeError, match="query heads per row"):
        cpu_kernels.decode_attention(torch.randn(4, 17, 64), k, k, lens, 1.0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu_kernels.decode_attention(q.bfloat16(), k, k, lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous in the head dim"):
        kt = torch.randn(4, 64, 10).transpose(1, 2)
        cpu_kernels.decode_attention(q, kt, kt, lens, 1.0)
    with pytest.raises(RuntimeError, match="lens must be"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([1, 2, 3]), 1.0)
    with pytest.raises(RuntimeError, match="outside the 10 keys"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([3, 11]), 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.decode_attention(q.double(), k.double(), k.double(), lens, 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(8, 4), (4, 4), (12, 4), (6, 2)])
def test_paged_equals_the_gathered_keys(dtype, heads):
    """Scattered slots (tails of the table are junk past each length): the paged kernel gives
    the gathered kernel's output exactly, and matches float64."""
    num_heads, kv_heads = heads
    gen = torch.Generator().manual_seed(3)
    bsz, width, dim, num_slots = 5, 70, 64, 600
    k_pool = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:width] for _ in range(bsz)])
    lens = torch.tensor([70, 1, 33, 16, 47])
    slots[1, 1:] = 10**9  # junk past a row's length is never read
    q = torch.randn(bsz, num_heads, dim, generator=gen).to(dtype)
    out = cpu_kernels.decode_attention_paged(q, k_pool, v_pool, slots, lens, 0.125)

    group = num_heads // kv_heads
    safe = slots.clamp(max=num_slots - 1)
    k = k_pool[safe].permute(2, 0, 1, 3).reshape(kv_heads * bsz, width, dim)  # head-major rows
    v = v_pool[safe].permute(2, 0, 1, 3).reshape(kv_heads * bsz, width, dim)
    qh = q.view(bsz, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads * bsz, group, dim)
    want, lse = cpu_kernels.decode_attention(qh, k, v, lens, 0.125)
    _check(want, lse, qh, k, v, lens, 0.125)
    want = want.view(kv_heads, bsz, group, dim).transpose(0, 1).reshape(bsz, num_heads, dim)
    assert torch.equal(out, want)


def test_paged_bad_arguments_name_the_problem():
    q, pool = torch.randn(2, 8, 64), torch.randn(50, 4, 64)
    slots, lens = torch.zeros(2, 10, dtype=torch.int64), torch.tensor([3, 10])
    paged = cpu_kernels.decode_attention_paged
    with pytest.raises(RuntimeError, match="do not fit"):
        paged(torch.randn(2, 6, 64), pool, pool, slots, lens, 1.0)
    with pytest.raises(RuntimeError, match="slots must be int64"):
        paged(q, pool, pool, slots.int(), lens, 1.0)
    with pytest.raises(RuntimeError, match="lens must be"):
        paged(q, pool, pool, slots, torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="outside the 10 slots"):
        paged(q, pool, pool, slots, torch.tensor([3, 11]), 1.0)
    bad = slots.clone()
    bad[1, 2] = 50
    with pytest.raises(RuntimeError, match="slot 50 is outside the pool's 50"):
        paged(q, pool, pool, bad, lens, 1.0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        paged(q, pool.bfloat16(), pool.bfloat16(), slots, lens, 1.0)

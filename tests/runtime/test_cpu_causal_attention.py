"""`arborlm::causal_attention`, ArborLM's CPU attention for an extend's new tokens, against
float64 attention computed from the definition, and the engine's extends that run through it.

Shapes cover plain prompts (as many keys as queries) and extends on a cached prefix (more keys:
query i sees keys 0 .. S - T + i), query counts around the 12-row tiles and 48-row blocks, key
counts across the 32-key panels and 256-key softmax blocks, 1 to 4 query heads per KV head, head
dims 16 to 256 (the value tiles of 1, 2, 3 and 4 vectors, and chunks of them); strided q/k/v
(slices of a fused projection); one and two threads; a traced call; and the errors on bad
arguments. float32 must agree with float64 to float32 rounding; bfloat16 (inputs widened
exactly, float32 sums, probabilities rounded to bfloat16 as ATen's kernel rounds them) within
one bfloat16 rounding of the probabilities and one of the output. A query's output must not
depend on the queries after it (a prompt prefilled in chunks gets the same numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from arborlm import Engine
from arborlm.runtime.platforms.cpu import attention as cpu_attention
from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from tests.runtime.engine_helpers import GREEDY, hf_greedy

# These tests follow the kernels that run without deterministic inference (the causal
# kernel, cascade attention, oneDNN above 128 rows); bfloat16 engines turn it on by default.
NOT_DETERMINISTIC = {"enable_deterministic_inference": False}

DTYPES = [torch.float32, torch.bfloat16]
# (new tokens T, keys S, query heads, KV heads, head dim)
SHAPES = [(1, 1, 1, 1, 16), (5, 5, 4, 2, 16), (13, 13, 2, 2, 32), (49, 49, 2, 1, 64),
          (100, 300, 4, 1, 64), (130, 130, 8, 4, 64), (33, 600, 2, 2, 128), (70, 70, 3, 3, 80),
          (13, 20, 2, 1, 256), (60, 61, 2, 2, 48), (1, 257, 4, 4, 64), (97, 353, 6, 2, 96)]


@pytest.fixture(autouse=True)
def kernels_or_skip():
    if not capabilities.kernel_instructions(torch.float32):
        pytest.skip("this CPU lacks AVX-512, which causal_attention needs")
    assert cpu_kernels.attention_available(torch.float32), "the CPU supports it but no build"


def _reference(q, k, v, scale):
    tokens, heads, _ = q.shape
    keys, kv_heads, _ = k.shape
    kk = k.double().repeat_interleave(heads // kv_heads, dim=1)
    vv = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    seen = torch.ones(tokens, keys, dtype=torch.bool).tril(keys - tokens)
    probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, vv), torch.einsum("hts,shd->thd", probs, vv.abs())


def _case(shape, dtype, gen):
    """q, k, v as views of one fused projection's rows, as the model hands them over."""
    tokens, keys, heads, kv_heads, dim = shape
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(keys, width, generator=gen).to(dtype)
    q = qkv[keys - tokens:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(keys, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(keys, kv_heads, dim)
    return q, k, v


def _check(out, q, k, v, scale):
    ref, size = _reference(q, k, v, scale)
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous()
    # Weighted means of values with |v| <~ 4: float32 ~1e-6; bfloat16 one rounding of the
    # probabilities (weighting |v|) and one of the output.
    tol = 2e-5 if q.dtype == torch.float32 else 2.0 ** -8 * (ref.abs() + size) + 1e-5
    err = (out.double() - ref).abs()
    assert bool((err <= tol).all()), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64(dtype, threads, torch_threads):
    gen = torch.Generator().manual_seed(0)
    torch_threads(threads)
    for shape in SHAPES:
        q, k, v = _case(shape, dtype, gen)
        scale = shape[4] ** -0.5
        _check(cpu_kernels.causal_attention(q, k, v, scale), q, k, v, scale)
        # contiguous copies give the same numbers as the strided views
        assert torch.equal(cpu_kernels.causal_attention(q.contiguous(), k.contiguous(),
                                                        v.contiguous(), scale),
                           cpu_kernels.causal_attention(q, k, v, scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_query_does_not_depend_on_later_ones(dtype):
    """The first t queries alone (with the keys they see) give their rows of the whole call,
    bit for bit: chunked prefill and one-shot prefill agree."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = _case((300, 400, 4, 2, 64), dtype, gen)
    whole = cpu_kernels.causal_attention(q, k, v, 0.125)
    for t in (1, 47, 48, 49, 130, 299):
        part = cpu_kernels.causal_attention(q[:t], k[:100 + t], v[:100 + t], 0.125)
        assert torch.equal(part, whole[:t]), t


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_prefix_attention_matches_float64(dtype):
    """Cascade decode's shared part: members of two groups (one with more members than a
    48-row block) attend to their group's prefix, read from scattered pool rows; a request in
    no group gets zeros and -inf."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 4, 2, 64
    pool_k = torch.randn(900, kv_heads, dim, generator=gen).to(dtype)
    pool_v = torch.randn(900, kv_heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(900, generator=gen)[:2 * 300].view(2, 300)
    lens = torch.tensor([300, 77])
    groups = torch.tensor([0] * 50 + [-1] + [1] * 3)
    q = torch.randn(groups.numel(), heads, dim, generator=gen).to(dtype)
    out, lse = cpu_kernels.prefix_attention(q, pool_k, pool_v, slots, lens, groups, 0.125)
    assert out.dtype == lse.dtype == torch.float32
    for b, g in enumerate(groups.tolist()):
        if g < 0:
            assert bool((out[b] == 0).all()) and bool(torch.isinf(lse[b]).all())
            continue
        rows = slots[g, :lens[g]]
        k = pool_k[rows].double().repeat_interleave(heads // kv_heads, dim=1)  # [P, H, D]
        v = pool_v[rows].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,phd->hp", q[b].double(), k) * 0.125
        ref = torch.einsum("hp,phd->hd", scores.softmax(dim=-1), v)
        size = torch.einsum("hp,phd->hd", scores.softmax(dim=-1), v.abs())
        tol = 2e-5 if dtype == torch.float32 else 2.0 ** -8 * size + 1e-5
        assert bool(((out[b].double() - ref).abs() <= tol).all()), b
        assert torch.allclose(lse[b].double(), torch.logsumexp(scores, dim=-1), atol=1e-5)


def test_traced_call():
    gen = torch.Generator().manual_seed(2)
    q, k, v = _case((20, 30, 4, 2, 32), torch.float32, gen)

    def fn(q, k, v):
        return cpu_kernels.causal_attention(q * 2, k, v, 0.25) + 1

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    with torch.inference_mode():
        assert torch.equal(compiled(q, k, v), fn(q, k, v))


def test_bad_arguments_name_the_problem():
    q, k = torch.randn(4, 2, 64), torch.randn(10, 1, 64)
    with pytest.raises(RuntimeError, match=r"q \[T, H, D\], k and v \[S, Hkv, D\]"):
        cpu_kernels.causal_attention(q[0], k, k, 1.0)
    with pytest.raises(RuntimeError, match=r"q \[T, H, D\], k and v \[S, Hkv, D\]"):
        cpu_kernels.causal_attention(q, k, k[:9], 1.0)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_kernels.causal_attention(torch.randn(4, 3, 64), torch.randn(10, 2, 64),
                                     torch.randn(10, 2, 64), 1.0)
    with pytest.raises(RuntimeError, match="4 queries need at least as many keys, got 3"):
        cpu_kernels.causal_attention(q, k[:3], k[:3], 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.causal_attention(q[..., :40], k[..., :40], k[..., :40], 1.0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu_kernels.causal_attention(q.bfloat16(), k, k, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.causal_attention(q.double(), k.double(), k.double(), 1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extends_run_through_the_kernel(make_tiny_model, monkeypatch, dtype):
    """A fresh prompt and a prompt on a cached prefix (an extend whose queries see the prefix)
    attend through the kernel in every layer. In float32, greedy outputs equal the SDPA path's
    and transformers'. (bfloat16 rounds differently from ATen's kernel in a few ulps, which can
    flip a random model's near-ties: its numbers are checked in `test_matches_float64` and
    against transformers' logits in `test_model_numerics.py`.)"""
    path = str(make_tiny_model("llama"))
    calls = []
    kernel = cpu_kernels.causal_attention

    def counting(q, k, v, scale):
        calls.append((q.shape[0], k.shape[0]))
        return kernel(q, k, v, scale)

    monkeypatch.setattr(cpu_kernels, "causal_attention", counting)
    prefix = [(7 * i) % 400 + 10 for i in range(70)]
    prompts = [prefix + [5], prefix + [21, 22, 23]]
    engine = Engine(path, dtype=dtype, **NOT_DETERMINISTIC)
    outs = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    engine.shutdown()
    layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
    assert calls.count((71, 71)) == layers, "the fresh prompt did not attend through the kernel"
    assert calls.count((3, 73)) == layers, "the extend on its prefix did not use the kernel"

    # The same requests through SDPA (the extend's mask then built where the kernel declines).
    extend_metadata = cpu_attention.CpuAttentionBackend._extend_metadata

    def without_kernel(self, batch):
        meta = extend_metadata(self, batch)
        meta.kernel = False
        return meta

    monkeypatch.setattr(cpu_attention.CpuAttentionBackend, "_extend_metadata", without_kernel)
    calls.clear()
    engine = Engine(path, dtype=dtype, **NOT_DETERMINISTIC)
    sdpa = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    engine.shutdown()
    assert not calls
    if dtype == "float32":
        assert outs == sdpa
        for prompt, out in zip(prompts, outs):
            assert out == hf_greedy(path, prompt, GREEDY["max_new_tokens"])

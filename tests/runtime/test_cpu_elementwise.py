"""`arborlm::add_rms_norm` and `arborlm::silu_and_mul`, the fused float32 CPU kernels, against
float64 references and against the ATen forms they replace (`RMSNorm`, `silu_and_mul`).

Widths cover the 16-wide tails, rows are strided views (a fused projection's column slice),
one and two threads, the residual updated in place, and the errors on bad arguments. Greedy
sampling's `arborlm::argmax_rows` must equal `torch.argmax` exactly (ties, NaNs, infinities).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from arborlm.runtime.layers import activation
from arborlm.runtime.layers.norm import RMSNorm
from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

WIDTHS = [1, 15, 16, 64, 100, 512, 1408]


@pytest.fixture(autouse=True)
def kernels_or_skip():
    if not capabilities.kernel_instructions(torch.float32):
        pytest.skip("this CPU lacks AVX-512, which the kernels need")
    assert cpu_kernels.elementwise_available(torch.float32)


@pytest.mark.parametrize("threads", [1, 2])
def test_add_rms_norm_matches_float64(threads, torch_threads):
    gen = torch.Generator().manual_seed(0)
    torch_threads(threads)
    for n in WIDTHS:
        for rows in (1, 7, 300):
            wide = torch.randn(rows, n + 3, generator=gen)
            x = wide[:, 1:n + 1]  # strided rows
            residual = torch.randn(rows, n, generator=gen)
            w = torch.randn(n, generator=gen)
            total = residual.double() + x.double()
            ref = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
            before = residual.clone()
            out = cpu_kernels.add_rms_norm(x, residual, w, 1e-6)
            assert torch.allclose(residual, before + x, rtol=0, atol=0)  # in place, exact
            assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
            alone = cpu_kernels.add_rms_norm(x, None, w, 1e-6)
            plain = F.rms_norm(x.contiguous(), (n,), w, 1e-6)
            assert torch.allclose(alone, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_silu_and_mul_matches_float64(threads, torch_threads):
    gen = torch.Generator().manual_seed(1)
    torch_threads(threads)
    for n in WIDTHS:
        for rows in (1, 5, 200):
            gate_up = torch.randn(rows, 2 * n, generator=gen) * 6  # saturating both ways
            g, u = gate_up.double()[:, :n], gate_up.double()[:, n:]
            ref = g / (1 + torch.exp(-g)) * u
            out = cpu_kernels.silu_and_mul(gate_up)
            assert out.shape == (rows, n)
            assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-6)


def test_the_layers_route_float32_and_bfloat16_rows_to_the_kernels(monkeypatch):
    calls = []
    for name in ("add_rms_norm", "silu_and_mul"):
        kernel = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name,
                            lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    norm = RMSNorm(64, 1e-6, torch.float32)
    norm.weight.data.normal_()
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    want = F.rms_norm(residual + x, (64,), norm.weight, 1e-6)
    got, res = norm.forward_with_residual(x, residual)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) and res is residual
    gate_up = torch.randn(4, 128)
    assert torch.allclose(activation.silu_and_mul(gate_up),
                          F.silu(gate_up[:, :64]) * gate_up[:, 64:], rtol=1e-6, atol=1e-6)
    assert calls == ["add_rms_norm", "silu_and_mul"]
    # bfloat16 too (the fused decode step's arithmetic: RMSNorm rounded, then times the weight
    # and rounded, as the reference rounds), and per-head norms [T, H, D] as rows.
    norm.bfloat16()
    norm._kernel = None
    xb = torch.randn(3, 64).bfloat16()
    normed = F.rms_norm(xb.float(), (64,), eps=1e-6).bfloat16()
    torch.testing.assert_close(norm(xb), norm.weight * normed, atol=2 ** -6, rtol=2 ** -7)
    heads = torch.randn(5, 2, 64).bfloat16()
    assert torch.equal(norm(heads), norm(heads.reshape(10, 64)).view(5, 2, 64))
    activation.silu_and_mul(gate_up.bfloat16())
    assert calls == ["add_rms_norm", "silu_and_mul", "add_rms_norm", "add_rms_norm",
                     "add_rms_norm", "silu_and_mul"]


def test_bad_arguments_name_the_problem():
    w = torch.randn(8)
    with pytest.raises(RuntimeError, match="of one dtype"):
        cpu_kernels.add_rms_norm(torch.randn(2, 8).bfloat16(), None, w, 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_kernels.add_rms_norm(torch.randn(2, 8), None, torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be"):
        cpu_kernels.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), w, 1e-6)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_kernels.add_rms_norm(torch.randn(8, 2).t(), None, w, 1e-6)
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        cpu_kernels.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.silu_and_mul(torch.randn(2, 8).double())


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_is_torch_argmax(threads, torch_threads):
    """The first maximum of each row, ties and NaNs (the first NaN wins) included, as
    `torch.argmax`; strided rows; the sampler's greedy path uses it."""
    from arborlm.runtime.sampling.sampler import argmax

    gen = torch.Generator().manual_seed(3)
    torch_threads(threads)
    for n in WIDTHS + [8192, 32000]:
        for rows in (1, 3, 40):
            x = torch.randn(rows, n + 2, generator=gen)[:, 1:n + 1]
            assert torch.equal(cpu_kernels.argmax_rows(x), torch.argmax(x, dim=-1))
            x[:, n // 2] = x.max() + 1
            x[:, n - 1] = x.max()  # a tie: the first of the two
            assert torch.equal(cpu_kernels.argmax_rows(x), torch.argmax(x, dim=-1))
            assert torch.equal(argmax(x), torch.argmax(x, dim=-1))
    x = torch.randn(5, 100, generator=gen)
    x[1, 70], x[1, 30] = float("nan"), float("nan")
    x[2] = float("-inf")
    x[3, 99] = float("inf")
    x[4, 10] = float("nan")
    x[4, 11] = float("inf")
    assert cpu_kernels.argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist() \
        == [torch.argmax(x[0]).item(), 30, 0, 99, 10]


def test_argmax_rows_bad_arguments():
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.argmax_rows(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match=r"\[B, V\]"):
        cpu_kernels.argmax_rows(torch.randn(8))
    with pytest.raises(RuntimeError, match=r"\[B, V\]"):
        cpu_kernels.argmax_rows(torch.randn(2, 0))

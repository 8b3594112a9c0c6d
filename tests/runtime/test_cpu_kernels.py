"""`arborlm::row_gemv`, ArborLM's one-row CPU linear kernel, against a float64 reference.

Shapes cover the vector tails (inputs that are not multiples of the 16 / 32-element vectors or
of the 4-vector unroll), one and two threads, biases, traced calls inside `torch.compile`, the
errors on bad arguments, and the `PackedLinear` routing. float32 must agree with the float64
product to float32 summation error; bfloat16 (products of bfloat16 pairs summed in float32,
rounded once) must be within one bfloat16 rounding of it, as `F.linear` is.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.runtime.layers import cpu_kernels, cpu_linear

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1), (5, 17), (64, 64), (33, 130), (7, 100), (300, 1408), (1024, 512), (3, 4099)]


def _skip_unless_available(dtype: torch.dtype) -> None:
    if not cpu_kernels.cpu_supports(dtype):
        pytest.skip(f"this CPU lacks the instructions row_gemv needs for {dtype}")
    assert cpu_kernels.available(dtype), "the CPU supports row_gemv but it did not build"


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = x.double() @ w.double().t()
    if b is not None:
        ref = ref + b.double()
    assert y.dtype == x.dtype and y.shape == (1, w.shape[0])
    # float32: summation error of `in` terms; bfloat16: one rounding of the float32 sum.
    if x.dtype == torch.float32:
        bound = 1e-6 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    else:
        bound = 2.0 ** -8 * ref.abs() + 1e-4 * (x.double().abs() @ w.double().abs().t())
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64(dtype, threads, torch_threads):
    _skip_unless_available(dtype)
    gen = torch.Generator().manual_seed(0)
    torch_threads(threads)
    for out, inp in SHAPES:
        w = torch.randn(out, inp, generator=gen).to(dtype)
        x = torch.randn(1, inp, generator=gen).to(dtype)
        b = torch.randn(out, generator=gen).to(dtype)
        _check(cpu_kernels.row_gemv(x, w), x, w, None)
        _check(cpu_kernels.row_gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_views_and_traced_calls(dtype):
    """Strided inputs are read correctly, and a compiled graph calls the kernel (one graph,
    the same numbers as the eager call)."""
    _skip_unless_available(dtype)
    gen = torch.Generator().manual_seed(1)
    w_big = torch.randn(96, 400, generator=gen).to(dtype)
    w = w_big[:, :200]  # non-contiguous rows
    h = torch.randn(1, 600, generator=gen).to(dtype)
    x = h[:, 100:300]  # an offset view
    _check(cpu_kernels.row_gemv(x, w), x, w, None)

    def fn(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.row_gemv(torch.relu(a) * 2, weight) + 1

    compiled = torch.compile(fn, fullgraph=True, options={"cpp_wrapper": True})
    wc = w.contiguous()
    with torch.inference_mode():
        assert torch.equal(compiled(x, wc), fn(x, wc))


def test_bad_arguments_name_the_problem():
    _skip_unless_available(torch.float32)
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match=r"one row \[1, in\]"):
        cpu_kernels.row_gemv(torch.randn(2, 16), w)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_kernels.row_gemv(torch.randn(1, 15), w)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu_kernels.row_gemv(torch.randn(1, 16).bfloat16(), w)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernels.row_gemv(torch.randn(1, 16), w, torch.randn(7))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.row_gemv(torch.randn(1, 16).double(), w.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_packed_linear_routes_one_row_to_the_kernel(dtype, monkeypatch):
    """One row goes through `row_gemv` (float32 keeps the weight `[out, in]` for it); more rows
    through oneDNN; with ARBORLM_CPU_KERNELS=0 the kernel is never called."""
    _skip_unless_available(dtype)
    if not cpu_linear.packing_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    calls = []
    kernel = cpu_kernels.row_gemv

    def counting(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    monkeypatch.setattr(cpu_kernels, "row_gemv", counting)
    linear = torch.nn.Linear(256, 384, bias=True).to(dtype)
    packed = cpu_linear.PackedLinear(linear)
    assert packed.gemv and not packed.transposed
    x = torch.randn(3, 256).to(dtype)
    _check(packed(x[:1]), x[:1], linear.weight.detach(), linear.bias.detach())
    packed(x)
    assert calls == [torch.Size([1, 256])]

    monkeypatch.setenv("ARBORLM_CPU_KERNELS", "0")
    plain = cpu_linear.PackedLinear(linear)
    assert not plain.gemv
    plain(x[:1])
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("python_op", [False, True], ids=["cpp", "python"])
def test_traced_batches_call_the_packed_weight(dtype, python_op, monkeypatch):
    """A compiled call of a `PackedLinear` on 5 rows runs its packed weight through ArborLM's
    C++ operator (or, where the operators are not built, the Python one) and equals the eager
    oneDNN product bit for bit; the C++ registry lets go of a layer when it is collected, and an
    unknown number is a clear error."""
    if not cpu_linear.packing_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    if not python_op and not cpu_kernels.packed_linear_available():
        pytest.skip("ArborLM's CPU operators are not built here")
    if python_op:
        monkeypatch.setattr(cpu_kernels, "packed_linear_available", lambda: False)
    linear = torch.nn.Linear(256, 384, bias=True).to(dtype)
    packed = cpu_linear.PackedLinear(linear)
    assert packed.native == (not python_op)
    x = torch.randn(5, 256).to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: packed(x) * 2, fullgraph=True, backend="inductor")
    with torch.inference_mode():
        got, want = compiled(x), packed(x) * 2
    assert torch.equal(got, want)
    code = torch._inductor.codecache.PyCodeCache.modules  # the graphs' generated code
    called = "arborlm.packed_linear_py." if python_op else "arborlm.packed_linear."
    assert any(called in open(m.__file__).read() for m in code if m.__file__), called
    if not python_op:
        handle = packed.handle
        del packed, compiled
        torch._dynamo.reset()
        import gc
        gc.collect()
        with pytest.raises(RuntimeError, match=f"no packed layer number {handle}"):
            cpu_kernels.packed_linear(x, handle)

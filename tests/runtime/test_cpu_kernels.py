"""`arborlm::panel_linear`, ArborLM's CPU linear kernel for decode batches, against a float64
reference.

Shapes cover the vector tails (outputs that are not multiples of the 32-column panels, odd
inputs that end bfloat16 pairs half-way), row counts around the 12-row tiles and the 96-row
blocks, one and two threads, biases, traced calls inside `torch.compile`, the errors on bad
arguments, and the `PackedLinear` routing. float32 must agree with the float64 product to
float32 summation error; bfloat16 (products of bfloat16 pairs summed in float32, rounded once)
must be within one bfloat16 rounding of it, as `F.linear` is. Every row's result must not depend
on the other rows of the call.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu import linear as cpu_linear

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1), (5, 17), (64, 64), (33, 130), (7, 100), (300, 1408), (1024, 512), (3, 4099)]
ROWS = [1, 2, 11, 12, 13, 32, 97, 200]


def _skip_unless_available(dtype: torch.dtype) -> None:
    if not capabilities.kernel_instructions(dtype):
        pytest.skip(f"this CPU lacks the instructions panel_linear needs for {dtype}")
    assert cpu_kernels.available(dtype), "the CPU supports panel_linear but it did not build"


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = x.double() @ w.double().t()
    size = x.double().abs() @ w.double().abs().t()  # what the summation error scales with
    if b is not None:
        ref = ref + b.double()
        size = size + b.double().abs()
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    # float32: summation error of `in` terms (and the bias); bfloat16: one rounding of the
    # float32 sum.
    if x.dtype == torch.float32:
        bound = 1e-6 * size + 1e-30
    else:
        bound = 2.0 ** -8 * ref.abs() + 1e-4 * size
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


def _linear(x, w, b=None):
    return cpu_kernels.panel_linear(x, cpu_kernels.pack_panels(w), w.shape[0],
                                    None if b is None else b.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64(dtype, threads, torch_threads):
    _skip_unless_available(dtype)
    gen = torch.Generator().manual_seed(0)
    torch_threads(threads)
    for out, inp in SHAPES:
        w = torch.randn(out, inp, generator=gen).to(dtype)
        b = torch.randn(out, generator=gen).to(dtype)
        panels = cpu_kernels.pack_panels(w)
        for rows in ROWS if out * inp < 1 << 18 else (1, 13, 32):
            x = torch.randn(rows, inp, generator=gen).to(dtype)
            _check(_linear(x, w), x, w, None)
            y = cpu_kernels.panel_linear(x, panels, out, b.float())
            _check(y, x, w, b)
            one = cpu_kernels.panel_linear(x[-1:], panels, out, b.float())
            assert torch.equal(one, y[-1:]), "a row's result depends on the batch"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_views_and_traced_calls(dtype):
    """Strided inputs are read correctly, and a compiled graph calls the kernel (one graph,
    the same numbers as the eager call)."""
    _skip_unless_available(dtype)
    gen = torch.Generator().manual_seed(1)
    w_big = torch.randn(96, 400, generator=gen).to(dtype)
    w = w_big[:, :200]  # non-contiguous rows
    h = torch.randn(3, 600, generator=gen).to(dtype)
    x = h[:, 100:300]  # an offset view
    _check(_linear(x, w), x, w, None)
    panels = cpu_kernels.pack_panels(w)

    def fn(a: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.panel_linear(torch.relu(a) * 2, p, 96) + 1

    compiled = torch.compile(fn, fullgraph=True, options={"cpp_wrapper": True})
    with torch.inference_mode():
        assert torch.equal(compiled(x, panels), fn(x, panels))


def test_bad_arguments_name_the_problem():
    _skip_unless_available(torch.float32)
    w = torch.randn(40, 16)
    p = cpu_kernels.pack_panels(w)
    assert p.shape == (2, 16, 32)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, in\]"):
        cpu_kernels.panel_linear(torch.randn(16), p, 40)
    with pytest.raises(RuntimeError, match="panels are for 16 inputs, x has 15"):
        cpu_kernels.panel_linear(torch.randn(1, 15), p, 40)
    with pytest.raises(RuntimeError, match="panels must be pack_panels' BFloat16 layout"):
        cpu_kernels.panel_linear(torch.randn(1, 16).bfloat16(), p, 40)
    with pytest.raises(RuntimeError, match="2 panels cannot hold 65 outputs"):
        cpu_kernels.panel_linear(torch.randn(1, 16), p, 65)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernels.panel_linear(torch.randn(1, 16), p, 40, torch.randn(7))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.panel_linear(torch.randn(1, 16).double(), p, 40)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.pack_panels(w.double())
    with pytest.raises(RuntimeError, match=r"weight must be a CPU matrix"):
        cpu_kernels.pack_panels(torch.randn(4))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_packed_linear_routes_decode_batches_to_the_kernel(dtype, monkeypatch):
    """Up to `panel_max_rows` rows go through `panel_linear` (no plain copy is kept); more rows
    through oneDNN; with ARBORLM_CPU_KERNELS=0 the kernel is never called."""
    _skip_unless_available(dtype)
    if not cpu_linear.packing_available(dtype):
        pytest.skip("no oneDNN packed linear for this dtype here (the torch build or the CPU)")
    calls = []
    kernel = cpu_kernels.panel_linear

    def counting(*args):
        calls.append(args[0].shape[0])
        return kernel(*args)

    monkeypatch.setattr(cpu_kernels, "panel_linear", counting)
    linear = torch.nn.Linear(256, 384, bias=True).to(dtype)
    packed = cpu_linear.PackedLinear(linear)
    assert packed.panels is not None and packed.plain is None
    rows = packed.panel_rows
    assert rows == cpu_linear.panel_max_rows(dtype)
    x = torch.randn(rows + 1, 256).to(dtype)
    w, b = linear.weight.detach(), linear.bias.detach()
    _check(packed(x[:1]), x[:1], w, b)
    _check(packed(x[:rows]), x[:rows], w, b)
    packed(x)
    assert calls == [1, rows]

    monkeypatch.setenv("ARBORLM_CPU_KERNELS", "0")
    plain = cpu_linear.PackedLinear(linear)
    assert plain.panels is None and plain.plain is not None
    plain(x[:1])
    plain(x[:5])
    assert calls == [1, rows]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("python_op", [False, True], ids=["cpp", "python"])
def test_traced_batches_call_the_packed_weight(dtype, python_op, monkeypatch):
    """A compiled call of a `PackedLinear` on more rows than the panels take runs its packed
    weight through ArborLM's C++ operator (or, where the operators are not built, the Python
    one) and equals the eager oneDNN product bit for bit; the C++ registry lets go of a layer
    when it is collected, and an unknown number is a clear error."""
    if not cpu_linear.packing_available(dtype):
        pytest.skip("no oneDNN packed linear for this dtype here (the torch build or the CPU)")
    if not python_op and not cpu_kernels.packed_linear_available():
        pytest.skip("ArborLM's CPU operators are not built here")
    if python_op:
        monkeypatch.setattr(cpu_kernels, "packed_linear_available", lambda: False)
    monkeypatch.setattr(cpu_linear, "PANEL_MAX_ROWS", 4)  # 5 rows: a prefill-sized call
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
            cpu_linear.packed_linear(x, handle)

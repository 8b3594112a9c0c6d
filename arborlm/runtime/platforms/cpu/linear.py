"""Linear layers that pick, per call, the fastest CPU kernel for the batch size.

On CPU, `F.linear` hands its weight to MKL (float32) or oneDNN (bfloat16) in plain row-major
layout on every call, and the library copies it into its blocked layout each time: for the
small batches of decoding that copy costs as much as the product. `pack_linears` does it once,
after loading (`torch.ops.mkldnn._reorder_linear_weight`, as torch.compile's CPU freezing pass
does), and `PackedLinear` calls `torch.ops.mkldnn._linear_pointwise` for any number of rows:
prefill too, where the packed float32 product beats MKL's on the plain weight (figures in
docs/performance.md, "CPU kernels").

Decode-sized batches (up to `panel_max_rows` rows, one row included) go instead to ArborLM's own
kernel where the CPU has it, `cpu_kernels.panel_linear` over a second copy of the weight in
column panels (`csrc/panel_gemm.cpp`): a decode step's weights stream in from memory, where
oneDNN loses a fifth of its speed and the panels do not. Its results do not depend on the batch
size. Where oneDNN's bfloat16 GEMMs run on AMX tiles, they overtake the panels' `vdpbf16ps`
from about 16-24 rows on in an extend (docs/performance.md, "Prefill on AMX"), so bfloat16
batches above `AMX_PANEL_MAX_ROWS` go to oneDNN there (not with deterministic inference, which
keeps every batch on the panels: `panels_only`).

Where the panel kernel cannot run, the plain weight is kept instead: with one thread, one float32
row runs as `x @ W^T` with the weight stored transposed, MKL's fastest single-thread float32 GEMV
(MKL does not split it over threads; oneDNN does). bfloat16 results of oneDNN are bit-identical
to `F.linear` (the same kernels); float32 ones differ from it in the last bits (other summation
orders), as the panels' do. Two copies of each weight are kept (packed and panels, or packed and
plain), so the linear weights take twice their memory.

A oneDNN call costs microseconds more than MKL's for a tiny matrix, so weights below
`MIN_PACKED_ELEMENTS` stay plain `nn.Linear`. Not here: quantization, GPUs (cuBLAS as is).

Inside `torch.compile` (the compiled decode step) `panel_linear` is traced as an opaque call
on the panels. The opaque oneDNN copy cannot be traced: where the panels do not serve, one row
runs on the plain copy as `row_linear`, an elementwise product and a row sum that Inductor turns
into one streaming C++ kernel, and more rows through `packed_linear`, an opaque C++
operator that looks the layer up by number and calls its packed weight (`packed_linear_py`, the
same in Python, where the operators are not built). `row_linear` needs the weight row-major as
`[out, in]`, so `pack_linears(transpose_fp32=False)` keeps float32 plain copies untransposed
(the engine does so with `enable_torch_compile`), and `use_row_linears` gives the unpacked
small layers the same traced form (`RowLinear`).
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

# Smallest weight (out x in elements) worth packing; below it the call overhead dominates.
MIN_PACKED_ELEMENTS = 1 << 16
# Batch size the packed layout is tuned for; any batch size runs on it.
BATCH_HINT = 32
# Most rows a call gives the panel kernel; above it (prefill) oneDNN's blocking is as fast or
# faster (docs/performance.md, "CPU kernels").
PANEL_MAX_ROWS = 128
# The same for bfloat16 where oneDNN runs it on AMX tiles (docs/performance.md, "Prefill on AMX").
AMX_PANEL_MAX_ROWS = 16


def panel_max_rows(dtype: torch.dtype) -> int:
    """Most rows a `dtype` call gives the panel kernel on this CPU."""
    if dtype == torch.bfloat16 and capabilities.has_amx_bf16():
        return min(PANEL_MAX_ROWS, AMX_PANEL_MAX_ROWS)
    return PANEL_MAX_ROWS


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN and its packed-linear ops, for `dtype` on this CPU:
    oneDNN packs bfloat16 only where the CPU has AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only
    CPU has neither: its bfloat16 linears stay plain)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """`nn.Linear` for CPU inference (fp32 / bf16): oneDNN-packed for decode-sized batches."""

    def __init__(self, linear: nn.Linear, transpose_fp32: bool = True,
                 panels_only: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # Deterministic inference: every batch size on the panels (their sums run in one order
        # for any number of rows), and no oneDNN copy at all.
        self.panels_only = panels_only
        self.packed = None if panels_only else \
            torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)  # opaque
        # Decode batches go to ArborLM's panel kernel where it runs, eager or traced.
        self.panels = cpu_kernels.pack_panels(weight) if cpu_kernels.available(weight.dtype) \
            else None
        if panels_only and self.panels is None:
            raise ValueError(f"no panel kernel for {weight.dtype} on this CPU")
        # Without it, float32 keeps W^T (row-major [in, out]) unless told otherwise: `x @ W^T`
        # is MKL's faster one-thread GEMV; bfloat16 keeps W itself.
        self.transposed = weight.dtype == torch.float32 and transpose_fp32 and self.panels is None
        self.plain = None if self.panels is not None else \
            weight.t().contiguous() if self.transposed else weight  # [in, out] | [out, in]
        self.bias = linear.bias
        # The panel kernel adds a float32 bias (before rounding, as a GEMM's epilogue does).
        self.bias32 = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.panel_rows = panel_max_rows(weight.dtype)  # above: oneDNN (unless panels_only)
        # How a traced graph names it (`packed_linear`); `native`: the C++ operator holds it.
        self.handle, self.native = _register(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in]` -> `[T, out]` in x's dtype."""
        rows = x.shape[0]
        if self.panels is not None and (rows <= self.panel_rows or self.panels_only):
            return cpu_kernels.panel_linear(x, self.panels, self.out_features, self.bias32)
        if torch.compiler.is_compiling():  # traced: the opaque packed weight cannot be
            if rows == 1 and not self.transposed:  # no panels: a plain copy
                return row_linear(x, self.plain, self.bias)
            if self.native:  # an opaque call with the packed weight
                return packed_linear(x, self.handle)
            return packed_linear_py(x, self.handle)
        single_gemv = self.transposed and rows == 1 and torch.get_num_threads() == 1
        if single_gemv:
            return self._plain(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the plain (unpacked) copy of the weight."""
        if not self.transposed:
            return F.linear(x, self.plain, self.bias)
        if self.bias is None:
            return torch.mm(x, self.plain)
        return torch.addmm(self.bias, x, self.plain)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


# The registry of packed layers by number, for the calls a compiled graph makes (it cannot
# hold the opaque packed tensor): the Python operator and the traced shapes read it, and where
# ArborLM's C++ operators are built, the C++ operator's own table (`csrc/packed_linear.cpp`,
# so that a call stays in C++) holds the same layers, registered and forgotten with it.
_PACKED: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_handles = itertools.count()
_fake_registered = False


def _register(layer: PackedLinear) -> tuple[int, bool]:
    """Give `layer` a number; returns it and whether the C++ operator holds the layer too."""
    global _fake_registered
    handle = next(_handles)
    _PACKED[handle] = layer
    native = not layer.panels_only and cpu_kernels.packed_linear_available()
    if native:
        if not _fake_registered:
            torch.library.register_fake("arborlm::packed_linear")(_packed_linear_shape)
            _fake_registered = True
        torch.ops.arborlm.register_packed_linear(handle, layer.packed, layer.bias)
        forget = weakref.finalize(layer, torch.ops.arborlm.forget_packed_linear, handle)
        forget.atexit = False  # at exit the process lets go of everything anyway
    return handle, native


def packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x `[T, in]` times layer `handle`'s packed weight (plus bias) -> `[T, out]`, through the
    C++ operator (`mkldnn::_linear_pointwise` called without a Python frame); the layer must be
    registered with it (`PackedLinear.native`)."""
    return torch.ops.arborlm.packed_linear(x, handle)


@torch.library.custom_op("arborlm::packed_linear_py", mutates_args=())
def packed_linear_py(x: torch.Tensor, handle: int) -> torch.Tensor:
    """`PackedLinear` number `handle` on x `[T, in]`, through its packed oneDNN weight: how a
    compiled graph (which cannot hold the opaque packed tensor) calls it for batches where
    ArborLM's C++ operators are not built (`packed_linear` otherwise)."""
    layer = _PACKED[handle]
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


@packed_linear_py.register_fake
def _packed_linear_shape(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _PACKED[handle].out_features))


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One row `x` `[1, in]` times `weight` `[out, in]`, summed in float32 (as a GEMM does) and
    rounded once to x's dtype: `[1, out]`. Written for Inductor, which fuses it into one kernel
    that streams the weight once; eagerly it would materialise the `[out, in]` product."""
    out = (x.float() * weight.float()).sum(dim=-1, keepdim=True).t()  # [1, out] float32
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class RowLinear(nn.Linear):
    """`nn.Linear` whose one-row products become `row_linear` kernels inside `torch.compile`
    (for weights too small to pack, where a library call costs more than the product)."""

    @classmethod
    def of(cls, linear: nn.Linear) -> RowLinear:
        """A `RowLinear` sharing `linear`'s parameters."""
        row = skip_init(cls, linear.in_features, linear.out_features, bias=False,
                        dtype=linear.weight.dtype, device="meta")
        row.weight, row.bias = linear.weight, linear.bias
        return row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in]` -> `[T, out]`: `F.linear`, or `row_linear` for one traced row."""
        if torch.compiler.is_compiling() and x.shape[0] == 1:
            return row_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _eligible(module: nn.Module, panels_only: bool = False) -> bool:
    if type(module) is not nn.Linear:
        return False
    w = module.weight
    return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and (panels_only or (w.numel() >= MIN_PACKED_ELEMENTS
                                 and packing_available(w.dtype))))


def pack_linears(model: nn.Module, transpose_fp32: bool = True,
                 panels_only: bool = False) -> int:
    """Replace every eligible `nn.Linear` of `model` by a `PackedLinear`; returns how many.

    The model must be loaded: the copies are taken now, and a replaced module's original
    weight is released unless something else (a tied embedding, a plain copy) holds it.
    `transpose_fp32=False` keeps float32 plain copies as `[out, in]` (see the module doc).
    `panels_only` (deterministic inference) packs every CPU linear, however small, into panels
    alone, which then serve every batch size; `cpu_kernels.available` must hold for its dtype.
    """
    if not panels_only and not packing_available():
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if _eligible(child, panels_only)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, transpose_fp32, panels_only))
    return len(targets)


def use_row_linears(model: nn.Module) -> int:
    """Replace every plain CPU `nn.Linear` of `model` (those too small to pack) by a
    `RowLinear` over the same parameters; returns how many. Eager results do not change."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu"]
    for parent, name, child in targets:
        setattr(parent, name, RowLinear.of(child))
    return len(targets)

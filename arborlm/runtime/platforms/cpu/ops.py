"""`CpuKernelOps`: the layers' elementwise operators on ArborLM's CPU kernels.

RMSNorm (with or without the residual add) and SwiGLU run in one pass over the activations
each, with the fused decode step's arithmetic (`csrc/row_ops.h`), so that a token's norm is
the same whichever path computes it; argmax is vectorized. Inputs a kernel does not take
(strided rows, a weight of another dtype, float32-only argmax on other dtypes) fall back to
the PyTorch forms of `LayerOps`. `arborlm.runtime.layers.registry.ops_for` hands this table out
where `kernels.elementwise_available` holds.
"""

from __future__ import annotations

import torch

from arborlm.runtime.layers.ops import LayerOps
from arborlm.runtime.platforms.cpu import kernels


class CpuKernelOps(LayerOps):
    """`LayerOps` over `kernels.add_rms_norm`, `kernels.silu_and_mul` and
    `kernels.argmax_rows` (float32 and bfloat16 activations, on AVX-512)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != weight.dtype or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        if x.dim() == 2:
            return kernels.add_rms_norm(x, None, weight, eps)
        rows = x.reshape(-1, weight.shape[0])  # per-head norms (q/k): [T * H, D]
        return kernels.add_rms_norm(rows, None, weight, eps).view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        if x.dtype != weight.dtype or x.stride(-1) != 1 or x.dim() != 2 \
                or residual.stride(-1) != 1 or residual.shape != x.shape:
            return super().add_rms_norm(x, residual, weight, eps)
        return kernels.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(-1) != 1:
            return super().silu_and_mul(gate_up)
        return kernels.silu_and_mul(gate_up)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.stride(-1) != 1 or x.shape[-1] == 0:
            return super().argmax(x)
        return kernels.argmax_rows(x)

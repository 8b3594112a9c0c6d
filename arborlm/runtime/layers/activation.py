"""Gated activations over a fused gate/up projection.

The MLP's gate and up projections are one matmul whose output holds `[gate | up]`;
`silu_and_mul` splits it and computes `silu(gate) * up`, the Llama-family SwiGLU. The split is a
pair of views, so the only new tensors are the activation and the product; eager float32 and
bfloat16 rows on a CPU with AVX-512 go through ArborLM's one-pass kernel
(`cpu_kernels.silu_and_mul`, the fused decode step's arithmetic) instead.
Nothing here owns parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from arborlm.runtime.layers import cpu_kernels

_kernel: dict[torch.dtype, bool] = {}  # dtype -> the CPU kernel runs for it


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up` `[T, 2I]` (gate first, then up) -> `silu(gate) * up` `[T, I]`."""
    if (gate_up.device.type == "cpu" and gate_up.dim() == 2 and gate_up.stride(-1) == 1
            and not torch.compiler.is_compiling() and _kernel_runs(gate_up.dtype)):
        return cpu_kernels.silu_and_mul(gate_up)
    inter = gate_up.shape[-1] // 2
    gate = gate_up[..., :inter]  # [T, I]
    up = gate_up[..., inter:]  # [T, I]
    return F.silu(gate).mul_(up)


def _kernel_runs(dtype: torch.dtype) -> bool:
    if dtype not in _kernel:
        _kernel[dtype] = cpu_kernels.elementwise_available(dtype)
    return _kernel[dtype]

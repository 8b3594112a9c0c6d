"""Gated activations over a fused gate/up projection.

The MLP's gate and up projections are one matmul whose output holds `[gate | up]`;
`silu_and_mul` computes `silu(gate) * up`, the Llama-family SwiGLU, with the layers' operator
table (`arborlm.runtime.layers.registry.ops_for`: PyTorch's form or a platform's one-pass kernel;
traced steps keep PyTorch's). Nothing here owns parameters.
"""

from __future__ import annotations

import torch

from arborlm.runtime.layers.ops import TORCH_OPS
from arborlm.runtime.layers.registry import ops_for


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up` `[T, 2I]` (gate first, then up) -> `silu(gate) * up` `[T, I]`."""
    if torch.compiler.is_compiling():
        return TORCH_OPS.silu_and_mul(gate_up)
    return ops_for(gate_up.device, gate_up.dtype).silu_and_mul(gate_up)

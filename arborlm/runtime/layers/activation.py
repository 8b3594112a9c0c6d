"""Gated activations over a fused gate/up projection.

The MLP's gate and up projections are one matmul whose output holds `[gate | up]`;
`silu_and_mul` splits it and computes `silu(gate) * up`, the Llama-family SwiGLU. The split is a
pair of views, so the only new tensors are the activation and the product. Nothing here owns
parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up` `[T, 2I]` (gate first, then up) -> `silu(gate) * up` `[T, I]`."""
    inter = gate_up.shape[-1] // 2
    gate = gate_up[..., :inter]  # [T, I]
    up = gate_up[..., inter:]  # [T, I]
    return F.silu(gate).mul_(up)

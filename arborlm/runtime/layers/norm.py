"""RMSNorm with the numerics of Hugging Face's `LlamaRMSNorm`, optionally fused with a residual add.

The arithmetic is the layers' operator table's (`arborlm.runtime.layers.registry.ops_for`):
PyTorch's form (`LayerOps.rms_norm`, bit-exact with `transformers` in bfloat16) or a platform's
fused kernel with the same rounding. Traced steps keep the PyTorch form, which Inductor fuses
itself.

This module holds no parameters other than the weight and does not know about tensor
parallelism or quantisation.
"""

from __future__ import annotations

import torch
from torch import nn

from arborlm.runtime.layers.ops import TORCH_OPS, LayerOps
from arborlm.runtime.layers.registry import ops_for


class RMSNorm(nn.Module):
    """`y = weight * (x / sqrt(mean(x^2) + eps))`, over the last dimension.

    The weight is created uninitialised (`torch.empty`): it is always loaded from a checkpoint.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self._shape = (size,)

    def _ops(self) -> LayerOps:
        if torch.compiler.is_compiling():
            return TORCH_OPS
        return ops_for(self.weight.device, self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., size]` -> `[..., size]` in x's dtype."""
        return self._ops().rms_norm(x, self.weight, self.eps)

    def forward_with_residual(self, x: torch.Tensor,
                              residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add `x` to `residual` in place, then normalise the sum.

        Returns `(norm(x + residual), x + residual)`; the second is `residual` itself, updated.
        The addition happens in the activation dtype, as in the reference decoder layer.
        """
        return self._ops().add_rms_norm(x, residual, self.weight, self.eps), residual

    def extra_repr(self) -> str:
        return f"{self._shape[0]}, eps={self.eps}"

"""RMSNorm with the numerics of Hugging Face's `LlamaRMSNorm`, optionally fused with a residual add.

The normalisation runs in float32 and is cast back to the input dtype *before* the weight is
applied, exactly as `transformers` does, so bfloat16 outputs agree bit for bit with the reference
(multiplying by the weight in float32 and rounding once would differ in the last bit).

This module holds no parameters other than the weight and does not know about tensor
parallelism or quantisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """`y = weight * (x / sqrt(mean(x^2) + eps))`, over the last dimension.

    The weight is created uninitialised (`torch.empty`): it is always loaded from a checkpoint.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self._shape = (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., size]` -> `[..., size]` in x's dtype."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self._shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self._shape, eps=self.eps).to(x.dtype)
        return self.weight * normed

    def forward_with_residual(self, x: torch.Tensor,
                              residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add `x` to `residual` in place, then normalise the sum.

        Returns `(norm(x + residual), x + residual)`; the second is `residual` itself, updated.
        The addition happens in the activation dtype, as in the reference decoder layer.
        """
        residual.add_(x)  # [T, size]
        return self.forward(residual), residual

    def extra_repr(self) -> str:
        return f"{self._shape[0]}, eps={self.eps}"

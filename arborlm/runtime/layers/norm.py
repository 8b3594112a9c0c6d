"""RMSNorm with the numerics of Hugging Face's `LlamaRMSNorm`, optionally fused with a residual add.

The normalisation runs in float32 and is cast back to the input dtype *before* the weight is
applied, exactly as `transformers` does, so bfloat16 outputs agree bit for bit with the reference
(multiplying by the weight in float32 and rounding once would differ in the last bit).

On a CPU with AVX-512, eager float32 and bfloat16 rows go through ArborLM's fused kernel
(`cpu_kernels.add_rms_norm`: the residual add and the norm in one pass, with the fused decode
step's arithmetic, so that a token's norm is the same whichever path computes it); traced steps
keep the ATen form, which Inductor fuses itself.

This module holds no parameters other than the weight and does not know about tensor
parallelism or quantisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from arborlm.runtime.layers import cpu_kernels


class RMSNorm(nn.Module):
    """`y = weight * (x / sqrt(mean(x^2) + eps))`, over the last dimension.

    The weight is created uninitialised (`torch.empty`): it is always loaded from a checkpoint.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self._shape = (size,)
        self._kernel: bool | None = None  # the CPU kernel runs for this weight (decided once)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether x `[..., size]` goes through `cpu_kernels.add_rms_norm`."""
        if torch.compiler.is_compiling() or x.dtype != self.weight.dtype \
                or x.stride(-1) != 1:
            return False
        if self._kernel is None:
            self._kernel = self.weight.device.type == "cpu" \
                and cpu_kernels.elementwise_available(self.weight.dtype)
        return self._kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., size]` -> `[..., size]` in x's dtype."""
        if self._fused(x):
            if x.dim() == 2:
                return cpu_kernels.add_rms_norm(x, None, self.weight, self.eps)
            rows = x.reshape(-1, self._shape[0])  # per-head norms (q/k): [T * H, D]
            return cpu_kernels.add_rms_norm(rows, None, self.weight, self.eps).view(x.shape)
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
        if self._fused(x) and x.dim() == 2 and residual.stride(-1) == 1 \
                and residual.shape == x.shape:
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual.add_(x)  # [T, size]
        return self.forward(residual), residual

    def extra_repr(self) -> str:
        return f"{self._shape[0]}, eps={self.eps}"

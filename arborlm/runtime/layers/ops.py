"""`LayerOps`: the elementwise operators model layers call, in PyTorch's own form.

RMSNorm (with the numerics of Hugging Face's `LlamaRMSNorm`), a residual add fused with it,
SwiGLU over a fused gate/up projection, and a row-wise argmax. A platform with kernels of its
own subclasses this table (`arborlm.runtime.platforms.cpu.ops`);
`arborlm.runtime.layers.registry.ops_for` picks the table once per device and dtype, and the
layers call whatever it picked. Traced code (`torch.compile`) always gets this table, which the
compiler fuses itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerOps:
    """The PyTorch forms: any device, any dtype."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x `[..., size]` -> `weight * (x / sqrt(mean(x^2) + eps))` in x's dtype.

        The normalisation runs in float32 and is cast back to the input dtype *before* the
        weight is applied, exactly as `transformers` does, so bfloat16 outputs agree bit for
        bit with the reference (multiplying by the weight in float32 and rounding once would
        differ in the last bit)."""
        shape = (weight.shape[0],)
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, shape, weight, eps)
        return weight * F.rms_norm(x.float(), shape, eps=eps).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """Add `x` to `residual` in place (in the activation dtype, as the reference decoder
        layer does) and return the RMSNorm of the sum."""
        residual.add_(x)  # [T, size]
        return self.rms_norm(residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`gate_up` `[T, 2I]` (gate first, then up) -> `silu(gate) * up` `[T, I]`; the split is
        a pair of views, so the only new tensors are the activation and the product."""
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax `[B]` of x `[B, V]` (the first where the maximum repeats)."""
        return torch.argmax(x, dim=-1)


TORCH_OPS = LayerOps()

"""`QuantLinearStack`: a stacked linear (q/k/v, gate/up) whose parts are packed in different types.

The model computes q/k/v and gate/up as one linear each (`llama.STACKED_LINEARS`). A Q4_K_M file
stores their parts in different types (attn_v in Q6_K beside Q4_K q/k, or Q8_0 beside Q5_0
where rows are not whole 256-value blocks), so their blocks cannot be one `QuantLinear`: each
part keeps its own, and the outputs are concatenated in the stacked order. The bias is one
parameter over all rows (what `load_weights` fills by rows, as for an `nn.Linear`).

Not here: the packed kernel (`quant_linear.py`), deciding which parts go where (`quant_loading.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from arborlm.runtime.platforms.cpu.quant_linear import QuantLinear


class QuantLinearStack(nn.Module):
    """`nn.Linear` `[in] -> [sum of the parts' out]`: `parts` (bias-free `QuantLinear`s of one
    input size) one after another, plus `bias` `[out]` (zeros to be loaded) when `has_bias`."""

    def __init__(self, parts: list[QuantLinear], has_bias: bool):
        super().__init__()
        assert parts and len({p.in_features for p in parts}) == 1
        assert all(p.bias is None for p in parts)
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) \
            if has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., in]` -> `[..., out]` in x's dtype."""
        y = torch.cat([part(x) for part in self.parts], dim=-1)  # [..., out]
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stacked weight `[out, in]` decoded (a fresh copy, for references and tests)."""
        return torch.cat([part.dequantized(dtype) for part in self.parts])

    def extra_repr(self) -> str:
        types = ", ".join(f"{p.out_features} {p.qtype.name}" for p in self.parts)
        return f"in_features={self.in_features}, parts=({types})"

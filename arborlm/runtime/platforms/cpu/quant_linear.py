"""`QuantLinear`: a CPU linear whose weight stays in GGUF's packed blocks, never dequantized.

The weight is a GGUF tensor's rows as the file stores them (`[out, row bytes]` uint8, Q8_0,
Q4_0/1, Q5_0/1, Q4_K, Q5_K or Q6_K), and every call runs `cpu_kernels.quant_linear` on them,
on the path `cpu_kernels.quant_path` chooses for the call's number of rows (weights dequantized
in registers against float activations from 8 rows, AVX512-VNNI dot products on activations
in two int8 terms below that; without AVX-512 the same two ways on AVX2; a portable path on CPUs
without AVX2). `quantize_linears`
turns a float model's `nn.Linear`s into `QuantLinear`s by quantizing their weights with the
`gguf` package's own quantizers (the 32-value types it writes: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).

Not here: `--quantization` at load (`quant_loading.py`: a GGUF file's packed tensors, a float
model's decoder), the tied embedding, or the decode executors (the fused decode step takes these
modules' blocks and runs the same kernel on the same path, `fused_decode.PackedWeights`; the
compiled and CUDA-graph steps read float weights and decline a model with them).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

T = GGMLQuantizationType
# The types `quant_linear` computes from, and those `quantize_linears` can write.
PACKED_TYPES = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K})
QUANTIZABLE_TYPES = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1})


class QuantLinear(nn.Module):
    """`nn.Linear` over packed GGUF rows `blocks` `[out, row bytes]` uint8 of type `qtype`."""

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if qtype not in PACKED_TYPES:
            raise ValueError(f"no packed kernel for GGUF type {qtype.name}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if in_features % block or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != in_features // block * type_size:
            raise ValueError(f"{qtype.name} rows of {in_features} values are "
                             f"{in_features // block * type_size} bytes in {block}-value blocks; "
                             f"got {blocks.dtype} {tuple(blocks.shape)}")
        self.qtype, self.in_features, self.out_features = qtype, in_features, blocks.shape[0]
        self.path: str | None = None  # `quant_linear`'s path; None: chosen per call by rows
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(),
                                                           requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., in]` (float32 or bfloat16) -> `[..., out]` in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        y = cpu_kernels.quant_linear(rows, self.blocks, int(self.qtype), self.bias, self.path)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[out, in]` decoded (a fresh copy, for references and tests)."""
        from arborlm.runtime.models.gguf.dequant import dequantize_into

        out = torch.empty(self.out_features, self.in_features, dtype=dtype)
        dequantize_into(self.blocks.numpy(), self.qtype, out)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.qtype.name}")


def pin_path(model: nn.Module) -> str | None:
    """Make every `QuantLinear` of `model` run one `quant_linear` path whatever its number of
    rows (`cpu_kernels.batch_invariant_quant_path`), so a row's result does not depend on its
    batch: deterministic inference. Returns the path, None where the model has none."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return None
    path = cpu_kernels.batch_invariant_quant_path()
    for layer in layers:
        layer.path = path
    return path


def quantize_weight(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A float weight `[out, in]` in GGUF's `qtype` rows `[out, row bytes]` uint8 (the `gguf`
    package's quantizer, llama.cpp's reference rounding)."""
    from gguf.quants import quantize

    if qtype not in QUANTIZABLE_TYPES:
        raise ValueError(f"cannot quantize to {qtype.name}; one of "
                         f"{', '.join(sorted(t.name for t in QUANTIZABLE_TYPES))}")
    values = weight.detach().float().numpy()
    return torch.from_numpy(np.ascontiguousarray(quantize(values, qtype)))


def quantize_linears(model: nn.Module, qtype: GGMLQuantizationType) -> int:
    """Replace every CPU `nn.Linear` of `model` whose input size is a whole number of `qtype`
    blocks by a `QuantLinear` of its quantized weight; returns how many. A weight shared with
    another module (a tied embedding) is left as it is."""
    block = GGML_QUANT_SIZES[qtype][0]
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu"
               and child.in_features % block == 0 and id(child.weight) not in shared]
    for parent, name, child in targets:
        blocks = quantize_weight(child.weight, qtype)
        setattr(parent, name, QuantLinear(blocks, qtype, child.in_features, child.bias))
    return len(targets)

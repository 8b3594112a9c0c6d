"""`--quantization` at load: the decoder's linears become `QuantLinear`s over GGUF blocks.

Two ways in. `keep_packed` takes a GGUF file's tensor stream (`iter_gguf_tensors` with
`packed_types`) and installs its packed linear weights as they are: q/k/v and gate/up, which the
model stacks into one linear each (`llama.STACKED_LINEARS`), are stacked as blocks when every part
has the same type, and decoded to float otherwise (that linear then stays an `nn.Linear`).
`quantize_decoder` quantizes a loaded float model's decoder linears to one 32-value type.

Not here: the embedding and output head (they stay in the model dtype), deciding whether the
option applies (`EngineArgs.check_quantization`), executors (`registry.choose_decode_executor`:
the fused and compiled steps decline a model with `QuantLinear`s).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from gguf import GGMLQuantizationType
from torch import nn

from arborlm.runtime.models.gguf.tensors import PackedRows
from arborlm.runtime.models.llama import STACKED_LINEARS
from arborlm.runtime.platforms.cpu.quant_linear import QuantLinear, quantize_linears

logger = logging.getLogger(__name__)


def has_quant_linears(model: nn.Module) -> bool:
    """Whether any of `model`'s modules computes from packed blocks."""
    return any(isinstance(m, QuantLinear) for m in model.modules())


def quantize_decoder(model: nn.Module, qtype: GGMLQuantizationType) -> int:
    """Quantize the decoder layers' linears of a loaded model to `qtype`; returns how many."""
    count = quantize_linears(model.model.layers, qtype)
    logger.info("%d decoder linears quantized to %s", count, qtype.name)
    return count


def keep_packed(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | PackedRows]],
                dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Consume the stream `weights`, install its `PackedRows` in `model` as `QuantLinear`s, and
    return the float tensors left for `model.load_weights` (biases, norms, embedding, and the
    parts of a stacked linear whose types differ, decoded to `dtype`)."""
    packed: dict[str, PackedRows] = {}
    floats: list[tuple[str, torch.Tensor]] = []
    for name, tensor in weights:
        if isinstance(tensor, PackedRows):
            packed[name.removesuffix(".weight")] = tensor
        else:
            floats.append((name, tensor))
    installed = 0
    for module_name, parts in _linear_parts(model):
        rows = [packed.pop(p) for p in parts if p in packed]
        if not rows:
            continue
        if len(rows) == len(parts) and len({r.qtype for r in rows}) == 1 \
                and _install(model, module_name, rows):
            installed += 1
            continue
        logger.info("%s: parts of types %s are not stacked as blocks (or misshapen); decoded to %s",
                    module_name, [r.qtype.name for r in rows], dtype)
        floats += [(f"{p}.weight", r.dequantized(dtype)) for p, r in zip(parts, rows)]
    floats += [(f"{name}.weight", r.dequantized(dtype)) for name, r in packed.items()]
    logger.info("%d linears computed from the file's packed blocks", installed)
    return floats


def _linear_parts(model: nn.Module) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(a decoder linear's module name, the checkpoint linears stacked in it, in row order)."""
    for name, module in model.model.layers.named_modules(prefix="model.layers"):
        if not isinstance(module, nn.Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        yield name, tuple(f"{parent}.{p}" for p in STACKED_LINEARS.get(leaf, (leaf,)))


def _install(model: nn.Module, module_name: str, rows: list[PackedRows]) -> bool:
    """Replace linear `module_name` by a `QuantLinear` of `rows` stacked (its bias, if any,
    zeros here: `load_weights` fills it); False, replacing nothing, where the shapes differ."""
    linear = model.get_submodule(module_name)
    blocks = torch.cat([r.blocks for r in rows])  # [out, row bytes]
    if blocks.shape[0] != linear.out_features or rows[0].in_features != linear.in_features:
        return False  # misshapen: load_weights names the tensor and the shapes
    bias = None if linear.bias is None else torch.zeros(linear.out_features)
    parent, _, leaf = module_name.rpartition(".")
    setattr(model.get_submodule(parent), leaf,
            QuantLinear(blocks, rows[0].qtype, linear.in_features, bias))
    return True

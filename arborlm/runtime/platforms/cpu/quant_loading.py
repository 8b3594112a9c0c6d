"""`--quantization` at load: the decoder's linears become `QuantLinear`s over GGUF blocks.

Two ways in. `keep_packed` takes a GGUF file's tensor stream (`iter_gguf_tensors` with
`packed_types`) and installs its packed linear weights as they are: q/k/v and gate/up, which the
model stacks into one linear each (`llama.STACKED_LINEARS`), are stacked as blocks when every part
has the same type, and decoded to float otherwise (that linear then stays an `nn.Linear`).
`quantize_decoder` quantizes a loaded float model's decoder linears to one 32-value type.

With tensor parallelism each rank keeps its shard's blocks (`TPShard.take_packed`): a file's
packed rows are sliced on whole blocks before they are stacked, and a float model quantizes its
already sharded linears, which gives the same blocks as slicing the whole model's (rows are
quantized independently, and a row-parallel shard starts on a block boundary).
`check_tp_blocks` refuses a tp size whose row-parallel shards would cut a block.

Not here: the embedding and output head (they stay in the model dtype), deciding whether the
option applies (`EngineArgs.check_quantization`), executors (`registry.choose_decode_executor`:
the fused and compiled steps decline a model with `QuantLinear`s).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from arborlm.runtime.config import ModelConfig
from arborlm.runtime.distributed.shard import TPShard
from arborlm.runtime.models.gguf.files import find_gguf_file, open_gguf
from arborlm.runtime.models.gguf.tensors import PackedRows
from arborlm.runtime.models.llama import STACKED_LINEARS
from arborlm.runtime.platforms.cpu.quant_linear import (
    PACKED_TYPES,
    QuantLinear,
    quantize_linears,
)

logger = logging.getLogger(__name__)


def has_quant_linears(model: nn.Module) -> bool:
    """Whether any of `model`'s modules computes from packed blocks."""
    return any(isinstance(m, QuantLinear) for m in model.modules())


# The llama.cpp names of the row-parallel linears (o_proj, down_proj).
_ROW_PARALLEL_GGUF = (".attn_output.weight", ".ffn_down.weight")


def check_tp_blocks(config: ModelConfig, quantization: str, shard: TPShard) -> None:
    """`ModelLoadError` naming the tp size and the block size when `shard`'s row-parallel
    inputs would cut a block of the packed type they compute from: `quantization`'s type, or
    for `gguf` each type the file packs its o/down projections in (a type `QuantLinear` cannot
    compute from is decoded to float and does not count)."""
    if shard.size == 1:
        return
    if quantization == "gguf":
        reader = open_gguf(find_gguf_file(config.path))
        types = {t.tensor_type for t in reader.tensors
                 if t.name.endswith(_ROW_PARALLEL_GGUF) and t.tensor_type in PACKED_TYPES}
    else:
        types = {GGMLQuantizationType[quantization.upper()]}
    for qtype in sorted(types, key=lambda t: -GGML_QUANT_SIZES[t][0]):
        shard.check_blocks(GGML_QUANT_SIZES[qtype][0], qtype.name)


def quantize_decoder(model: nn.Module, qtype: GGMLQuantizationType) -> int:
    """Quantize the decoder layers' linears of a loaded model (this rank's shard of them) to
    `qtype`; returns how many."""
    count = quantize_linears(model.model.layers, qtype)
    logger.info("%d decoder linears quantized to %s", count, qtype.name)
    return count


def keep_packed(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | PackedRows]],
                dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Consume the stream `weights`, install its `PackedRows` in `model` as `QuantLinear`s, and
    return the float tensors left for `model.load_weights` (biases, norms, embedding, and the
    parts of a stacked linear whose types differ, decoded to `dtype`; whole tensors, which
    `load_weights` shards). A `QuantLinear` holds `model.shard`'s blocks of its weight."""
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
                and _install(model, module_name, [_shard_of(model.shard, p, r)
                                                  for p, r in zip(parts, rows)]):
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


def _shard_of(shard: TPShard, name: str, rows: PackedRows) -> PackedRows:
    """This rank's blocks of the packed linear weight `name`."""
    block, type_size = GGML_QUANT_SIZES[rows.qtype]
    blocks = shard.take_packed(name, rows.blocks, block, type_size)  # [out part, row bytes]
    return PackedRows(blocks, rows.qtype, blocks.shape[1] // type_size * block)


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

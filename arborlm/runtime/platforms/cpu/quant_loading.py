"""`--quantization` at load: the linears and embedding become packed modules over GGUF blocks.

Two ways in. `keep_packed` takes a GGUF file's tensor stream (`iter_gguf_tensors` with
`packed_types`) and installs its packed weights as they are: q/k/v and gate/up, which the model
stacks into one linear each (`llama.STACKED_LINEARS`), are stacked as blocks where the parts
share a type, else kept per type in a `QuantLinearStack` (a Q4_K_M file's Q6_K attn_v beside
Q4_K q/k); the token embedding becomes a `QuantEmbedding` and the output head a `QuantLinear` —
over the embedding's own `blocks` tensor when they are tied, so the table is held once.
`quantize_model` quantizes a loaded float model into the same modules: each linear part to its
`part_type` (`q4_k`: llama.cpp's Q4_K_M mix), the embedding and head to `head_type`.

With tensor parallelism each rank keeps its shard's blocks (`TPShard.take_packed`): a file's
packed rows are sliced on whole blocks before they are stacked, and a float model quantizes its
already sharded linears, which gives the same blocks as slicing the whole model's (rows are
quantized independently, and a row-parallel shard starts on a block boundary).
`check_tp_blocks` refuses a tp size whose row-parallel shards would cut a block. The
vocabulary-parallel embedding and head keep their rank's vocabulary rows (whole rows of blocks).

Not here: deciding whether the option applies (`EngineArgs.check_quantization`), executors
(`registry.choose_decode_executor`: the fused step takes packed modules, the compiled step
declines them), the quantizers themselves (`kquants.py`, `quant_linear.quantize_weight`).
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
from arborlm.runtime.platforms.cpu.kquants import QK_K, quantize_q4_k, quantize_q6_k
from arborlm.runtime.platforms.cpu.quant_embedding import QuantEmbedding
from arborlm.runtime.platforms.cpu.quant_linear import PACKED_TYPES, QuantLinear
from arborlm.runtime.platforms.cpu.quant_linear import quantize_weight as quantize_blocks
from arborlm.runtime.platforms.cpu.quant_stack import QuantLinearStack

logger = logging.getLogger(__name__)
T = GGMLQuantizationType
K_QUANTS = frozenset({T.Q4_K, T.Q6_K})


def has_quant_linears(model: nn.Module) -> bool:
    """Whether any of `model`'s modules computes from packed blocks."""
    return any(isinstance(m, QuantLinear | QuantEmbedding | QuantLinearStack)
               for m in model.modules())


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


def quantize_model(model: nn.Module, quantization: str) -> int:
    """Quantize a loaded float model to `quantization` (`--quantization`, not gguf): each
    decoder linear part to its `part_type`, the embedding and head to `head_type` (tied: one
    table). Returns how many linears compute from blocks."""
    count = 0
    n_layers = len(model.model.layers)
    for module_name, parts in list(_linear_parts(model)):
        linear = model.get_submodule(module_name)
        layer = int(module_name.split(".")[2])  # model.layers.N...
        types = [part_type(quantization, p.rpartition(".")[2], layer, n_layers,
                           linear.in_features) for p in parts]
        weights = linear.weight.detach().split(_part_rows(model, module_name))
        blocks = [(quantize_weight(w, t), t) for w, t in zip(weights, types)]
        _replace(model, module_name, _packed_linear(blocks, linear.in_features, linear.bias))
        count += 1
    hidden, tied = model.config.hidden_size, model.config.tie_word_embeddings
    head = head_type(quantization, hidden)
    if head is None:
        logger.info("embedding and head stay float: rows of %d values", hidden)
    else:
        embed = model.model.embed_tokens
        blocks = quantize_weight(embed.weight, head)  # [vocab, row bytes]
        model.model.embed_tokens = QuantEmbedding(blocks, head, hidden, embed.weight.dtype)
        if not tied:
            blocks = quantize_weight(model.lm_head.weight, head)
        model.lm_head = QuantLinear(blocks, head, hidden)  # tied: the embedding's table
        count += 1
    logger.info("%d linears quantized to %s (embedding and head: %s)", count, quantization,
                "float" if head is None else head.name)
    return count


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in Q4_K_M."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 \
        or (layer - n_layers // 8) % 3 == 2


def part_type(quantization: str, part: str, layer: int, n_layers: int,
              in_features: int) -> GGMLQuantizationType:
    """The GGUF type checkpoint linear `part` (`q_proj`, ..., `down_proj`) of decoder layer
    `layer` is quantized to. `q4_k` is llama.cpp's Q4_K_M mix: Q4_K, with v_proj and down_proj
    in Q6_K in `_use_more_bits` layers; K-quant rows must be whole 256-value blocks, else
    llama.cpp's fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    qtype = T[quantization.upper()]
    if qtype == T.Q4_K and part in ("v_proj", "down_proj") and _use_more_bits(layer, n_layers):
        qtype = T.Q6_K
    if qtype in K_QUANTS and in_features % QK_K:
        qtype = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}[qtype]
    return qtype


def head_type(quantization: str, hidden: int) -> GGMLQuantizationType | None:
    """The type of the embedding and output head: Q8_0 with q8_0, else Q6_K (Q8_0 where rows of
    `hidden` values are not whole 256-value blocks), as llama.cpp's quantizer picks for the
    output tensor; None (they stay float) where rows are not whole 32-value blocks."""
    if hidden % 32:
        return None
    if quantization == "q8_0" or hidden % QK_K:
        return T.Q8_0
    return T.Q6_K


def quantize_weight(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A float weight `[out, in]` as GGUF `qtype` rows `[out, row bytes]` uint8: K-quants by
    `kquants.py`, the 32-value types by the `gguf` package (`quant_linear.quantize_weight`)."""
    if qtype == T.Q4_K:
        return quantize_q4_k(weight)
    if qtype == T.Q6_K:
        return quantize_q6_k(weight)
    return quantize_blocks(weight, qtype)


def _part_rows(model: nn.Module, module_name: str) -> list[int]:
    """Rows of each checkpoint linear stacked in decoder linear `module_name`, in order."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent, linear = model.get_submodule(parent_name), model.get_submodule(module_name)
    if leaf == "qkv_proj":
        return [parent.q_size, parent.kv_size, parent.kv_size]
    if leaf == "gate_up_proj":
        return [linear.out_features // 2] * 2
    return [linear.out_features]


def _packed_linear(parts: list[tuple[torch.Tensor, GGMLQuantizationType]], in_features: int,
                   bias: torch.Tensor | None) -> nn.Module:
    """A linear over packed `parts` (blocks `[rows, row bytes]`, type) stacked in order: one
    `QuantLinear` when adjacent parts share a type, else a `QuantLinearStack` (bias: zeros of
    its size are made here, `load_weights` fills them; a given tensor is copied in)."""
    runs: list[tuple[list[torch.Tensor], GGMLQuantizationType]] = []
    for blocks, qtype in parts:
        if runs and runs[-1][1] == qtype:
            runs[-1][0].append(blocks)
        else:
            runs.append(([blocks], qtype))
    merged = [(torch.cat(b) if len(b) > 1 else b[0], t) for b, t in runs]
    out = sum(b.shape[0] for b, _ in merged)
    if len(merged) == 1:
        b32 = None if bias is None else bias.detach().float().clone()
        return QuantLinear(merged[0][0], merged[0][1], in_features, b32)
    stack = QuantLinearStack([QuantLinear(b, t, in_features) for b, t in merged],
                             bias is not None)
    if bias is not None:
        stack.bias.copy_(bias.detach())
    assert stack.out_features == out
    return stack


def _replace(model: nn.Module, module_name: str, module: nn.Module) -> None:
    parent, _, leaf = module_name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


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
    for module_name, parts in list(_linear_parts(model)):
        rows = [packed.pop(p) for p in parts if p in packed]
        if not rows:
            continue
        if len(rows) == len(parts) and _install(model, module_name, [
                _shard_of(model.shard, p, r) for p, r in zip(parts, rows)]):
            installed += 1
            continue
        logger.info("%s: parts of types %s are not all packed (or misshapen); decoded to %s",
                    module_name, [r.qtype.name for r in rows], dtype)
        floats += [(f"{p}.weight", r.dequantized(dtype)) for p, r in zip(parts, rows)]
    embed, head = packed.pop("model.embed_tokens", None), packed.pop("lm_head", None)
    installed += _install_embedding(model, embed, head, dtype, floats)
    floats += [(f"{name}.weight", r.dequantized(dtype)) for name, r in packed.items()]
    logger.info("%d linears computed from the file's packed blocks", installed)
    return floats


def _install_embedding(model: nn.Module, embed: PackedRows | None, head: PackedRows | None,
                       dtype: torch.dtype, floats: list[tuple[str, torch.Tensor]]) -> int:
    """Install the packed embedding (and with tied embeddings the head over its blocks) and the
    packed head; a misshapen one is decoded into `floats` for `load_weights` to name. Returns
    how many linears (0 or 1: the head) now compute from blocks."""
    tied = model.config.tie_word_embeddings
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    if embed is not None:
        if tuple(embed.blocks.shape[:1]) == (vocab,) and embed.in_features == hidden:
            embed = _vocab_shard(model.shard, embed)
            model.model.embed_tokens = QuantEmbedding(embed.blocks, embed.qtype, hidden, dtype)
            if tied:
                head = embed  # the one table: its blocks tensor, not a copy
        else:
            floats.append(("model.embed_tokens.weight", embed.dequantized(dtype)))
    if head is None or (tied and head is not embed):
        return 0  # tied to a float embedding (a file's extra head is skipped by load_weights)
    if head is not embed:
        if head.blocks.shape[0] != vocab or head.in_features != hidden:
            floats.append(("lm_head.weight", head.dequantized(dtype)))
            return 0
        head = _vocab_shard(model.shard, head)
    model.lm_head = QuantLinear(head.blocks, head.qtype, hidden)
    return 1


def _linear_parts(model: nn.Module) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(a decoder linear's module name, the checkpoint linears stacked in it, in row order)."""
    for name, module in model.model.layers.named_modules(prefix="model.layers"):
        if not isinstance(module, nn.Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        yield name, tuple(f"{parent}.{p}" for p in STACKED_LINEARS.get(leaf, (leaf,)))


def _vocab_shard(shard: TPShard, rows: PackedRows) -> PackedRows:
    """This rank's vocabulary rows of a packed embedding or head `[vocab, row bytes]`, padded
    to `shard.vocab_rows` with all-zero blocks (which decode to zeros in every GGUF type)."""
    if shard.size == 1:
        return rows
    part = rows.blocks[shard.vocab_start:shard.vocab_start + shard.vocab_rows]
    if part.shape[0] < shard.vocab_rows:
        part = torch.cat([part, part.new_zeros(shard.vocab_rows - part.shape[0], part.shape[1])])
    return PackedRows(part.contiguous(), rows.qtype, rows.in_features)


def _shard_of(shard: TPShard, name: str, rows: PackedRows) -> PackedRows:
    """This rank's blocks of the packed linear weight `name`."""
    block, type_size = GGML_QUANT_SIZES[rows.qtype]
    blocks = shard.take_packed(name, rows.blocks, block, type_size)  # [out part, row bytes]
    return PackedRows(blocks, rows.qtype, blocks.shape[1] // type_size * block)


def _install(model: nn.Module, module_name: str, rows: list[PackedRows]) -> bool:
    """Replace linear `module_name` by a packed linear of `rows` stacked (its bias, if any,
    zeros here: `load_weights` fills it); False, replacing nothing, where the shapes differ."""
    linear = model.get_submodule(module_name)
    if sum(r.blocks.shape[0] for r in rows) != linear.out_features \
            or any(r.in_features != linear.in_features for r in rows):
        return False  # misshapen: load_weights names the tensor and the shapes
    bias = None if linear.bias is None else torch.zeros(linear.out_features)
    _replace(model, module_name,
             _packed_linear([(r.blocks, r.qtype) for r in rows], linear.in_features, bias))
    return True

"""`--quantization` at load: the linears and embedding become packed modules over GGUF blocks.

Two ways in. `keep_packed` takes a GGUF file's tensor stream (`iter_gguf_tensors` with
`packed_types`) and installs its packed weights as they are: q/k/v and gate/up, which the model
stacks into one linear each (`llama.STACKED_LINEARS`), are stacked as blocks when every part has
the same type, and decoded to float otherwise (that linear then stays an `nn.Linear`); the token
embedding becomes a `QuantEmbedding` and the output head a `QuantLinear` — over the embedding's
own `blocks` tensor when they are tied, so the table is held once. `quantize_model` quantizes a
loaded float model the same way: decoder linears to one type, embedding and head to `head_type`.

Not here: deciding whether the option applies (`EngineArgs.check_quantization`), executors
(`registry.choose_decode_executor`: the fused and compiled steps decline a model with packed
modules), the quantizers themselves (`quant_linear.quantize_weight`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from arborlm.runtime.models.gguf.tensors import PackedRows
from arborlm.runtime.models.llama import STACKED_LINEARS
from arborlm.runtime.platforms.cpu.quant_embedding import QuantEmbedding
from arborlm.runtime.platforms.cpu.quant_linear import (
    QuantLinear,
    quantize_linears,
    quantize_weight,
)

logger = logging.getLogger(__name__)


def has_quant_linears(model: nn.Module) -> bool:
    """Whether any of `model`'s modules computes from packed blocks."""
    return any(isinstance(m, QuantLinear | QuantEmbedding) for m in model.modules())


def quantize_model(model: nn.Module, qtype: GGMLQuantizationType) -> int:
    """Quantize a loaded float model: its decoder layers' linears to `qtype`, its embedding
    and output head to Q8_0 (what llama.cpp's quantizer gives a head whose rows are not whole
    256-value blocks; tied, one table). Returns how many linears compute from blocks."""
    count = quantize_linears(model.model.layers, qtype)
    head_type = GGMLQuantizationType.Q8_0
    embed, hidden = model.model.embed_tokens, model.config.hidden_size
    tied = model.config.tie_word_embeddings
    if hidden % GGML_QUANT_SIZES[head_type][0]:
        logger.info("embedding and head stay float: rows of %d values", hidden)
    elif isinstance(embed, nn.Embedding):
        blocks = quantize_weight(embed.weight, head_type)  # [vocab, row bytes]
        model.model.embed_tokens = QuantEmbedding(blocks, head_type, hidden, embed.weight.dtype)
        if tied:
            model.lm_head = QuantLinear(blocks, head_type, hidden)
            count += 1
        if not tied and type(model.lm_head) is nn.Linear:
            model.lm_head = QuantLinear(quantize_weight(model.lm_head.weight, head_type),
                                        head_type, hidden)
            count += 1
    logger.info("%d linears quantized (decoder: %s, embedding and head: %s)", count,
                qtype.name, head_type.name)
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
    hidden = model.config.hidden_size
    vocab = model.model.embed_tokens.num_embeddings
    if embed is not None:
        if tuple(embed.blocks.shape[:1]) == (vocab,) and embed.in_features == hidden:
            model.model.embed_tokens = QuantEmbedding(embed.blocks, embed.qtype, hidden, dtype)
            if tied:
                head = embed  # the one table: its blocks tensor, not a copy
        else:
            floats.append(("model.embed_tokens.weight", embed.dequantized(dtype)))
    if head is None or (tied and head is not embed):
        return 0  # tied to a float embedding (a file's extra head is skipped by load_weights)
    if head.blocks.shape[0] != model.lm_head.out_features or head.in_features != hidden:
        floats.append(("lm_head.weight", head.dequantized(dtype)))
        return 0
    model.lm_head = QuantLinear(head.blocks, head.qtype, hidden)
    return 1


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

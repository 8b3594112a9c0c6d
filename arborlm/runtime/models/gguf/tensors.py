"""Stream a GGUF file's tensors as Hugging Face-named torch tensors, one at a time.

`iter_gguf_tensors(file, dtype)` walks the memory-mapped file in order: each tensor's llama.cpp
name (`token_embd`, `blk.N.attn_q`, ..., `output_norm`, `output`) becomes the Hugging Face name,
its GGUF shape (fastest dimension first) becomes torch's (reversed), and its data is dequantized
into a fresh tensor of `dtype`. llama.cpp's converter interleaves the rows of each head of the
`llama` architecture's `attn_q` / `attn_k` (weights and biases) for its rotary kernel; those
rows are put back in Hugging Face's order, so the tensors equal what transformers loads from the
same file. Qwen2 and Qwen3 files are written unpermuted.

With `packed_types`, a decoder layer's linear weight (q/k/v/o, gate/up/down), the token embedding
or the output head of one of those types is not decoded: it comes as `PackedRows`, the file's
blocks (rows in Hugging Face's order) for `QuantLinear` / `QuantEmbedding` to compute from.

Not here: copying into parameters (the model's `load_weights`), the config (`metadata.py`),
building the packed modules (`platforms/cpu/quant_loading.py`).
A tensor of an unsupported type raises `ModelLoadError` naming the tensor and the type before
anything is decoded.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from arborlm.errors import ModelLoadError
from arborlm.runtime.models.gguf.dequant import SUPPORTED_TYPES, dequantize_into
from arborlm.runtime.models.gguf.files import metadata_value, open_gguf
from arborlm.runtime.models.gguf.metadata import gguf_architecture

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LINEAR_KINDS = frozenset({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                           "ffn_down"})
_PACKABLE_GLOBALS = frozenset({"token_embd.weight", "output.weight"})
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PERMUTED_QK = re.compile(r"^blk\.\d+\.attn_([qk])\.")
_CONSUMED_BY_CONFIG = frozenset({"rope_freqs.weight"})  # read by metadata.py
_PERMUTED_ARCHS = frozenset({"llama"})  # convert_hf_to_gguf.py's LlamaModel.permute


@dataclass(frozen=True)
class PackedRows:
    """A linear weight `[out, in]` as GGUF blocks: `blocks` `[out, row bytes]` uint8 of `qtype`."""

    blocks: torch.Tensor
    qtype: GGMLQuantizationType
    in_features: int

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight `[out, in]` decoded into a fresh tensor of `dtype`."""
        out = torch.empty(self.blocks.shape[0], self.in_features, dtype=dtype)
        dequantize_into(self.blocks.numpy(), self.qtype, out)
        return out


def _is_packable(gguf_name: str) -> bool:
    """Whether the tensor may stay packed: a decoder linear's weight, the embedding, the head."""
    if gguf_name in _PACKABLE_GLOBALS:
        return True
    match = _LAYER_TENSOR.match(gguf_name)
    return match is not None and match.group(2) in _LINEAR_KINDS and match.group(3) == "weight"


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None when it has none."""
    base, dot, leaf = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and leaf in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}{dot}{leaf}"
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, kind, leaf = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{leaf}"


def unpermute_rows(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)`: within each of `n_heads` heads the
    converter moved row pairs (i, i + half) next to each other; put them back."""
    rows = tensor.shape[0]
    assert rows % (2 * n_heads) == 0, (rows, n_heads)
    split = tensor.reshape(n_heads, rows // n_heads // 2, 2, *tensor.shape[1:])
    return split.transpose(1, 2).reshape(tensor.shape).contiguous()


def iter_gguf_tensors(file: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      packed_types: Collection[GGMLQuantizationType] = frozenset()
                      ) -> Iterator[tuple[str, torch.Tensor | PackedRows]]:
    """Yield `(Hugging Face name, tensor in dtype)` for every weight tensor of GGUF `file`; a
    decoder linear's, the embedding's or the head's weight of a type in `packed_types` comes as
    its `PackedRows` instead."""
    reader = open_gguf(file)
    arch = gguf_architecture(reader, file)
    wanted = []
    for t in reader.tensors:
        if t.name in _CONSUMED_BY_CONFIG:
            continue
        name = hf_tensor_name(t.name)
        if name is None:
            raise ModelLoadError(f"{file}: unexpected tensor {t.name!r} in a {arch} GGUF file")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{file}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which ArborLM "
                f"cannot load (supported: {', '.join(sorted(x.name for x in SUPPORTED_TYPES))})")
        wanted.append((name, t))
    n_heads = int(metadata_value(reader, f"{arch}.attention.head_count", 0))
    n_kv_heads = int(metadata_value(reader, f"{arch}.attention.head_count_kv", n_heads))
    for name, t in wanted:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF: fastest dim first
        keep = t.tensor_type in packed_types and _is_packable(t.name)
        if keep:  # [out, row bytes] uint8, the mapped file's bytes copied once
            out = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(shape[0], -1)
        else:
            out = torch.empty(shape, dtype=dtype)
            dequantize_into(t.data, t.tensor_type, out.view(-1, shape[-1]))
        permuted = _PERMUTED_QK.match(t.name)
        if arch in _PERMUTED_ARCHS and permuted:
            out = unpermute_rows(out, n_heads if permuted.group(1) == "q" else n_kv_heads)
        yield name, PackedRows(out, t.tensor_type, shape[-1]) if keep else out
    release_pages(reader)


def release_pages(reader) -> None:
    """Unmap the pages of `reader`'s file that reading touched: every tensor is copied out,
    and the cached reader (its metadata) would otherwise keep the whole file resident in this
    process. Its pages come back from the page cache if anything reads the mapping again."""
    mapping = getattr(reader.data, "_mmap", None)  # np.memmap's mmap.mmap
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)

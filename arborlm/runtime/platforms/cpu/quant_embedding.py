"""`QuantEmbedding`: a token embedding kept in GGUF's packed blocks, decoding only looked-up rows.

The table is a GGUF tensor's rows as the file stores them (`[vocab, row bytes]` uint8; a row of
`hidden` values is a whole number of blocks, or the file could not hold it). A lookup gathers
the rows of the ids asked for and decodes just those, in the model dtype, with the loader's own
decoder (`gguf.dequant.dequantize_into`), so each embedding equals the row the float loader
would have produced, bit for bit. With tied embeddings the output head is a `QuantLinear` over
the same `blocks` tensor: one copy serves both.

Not here: the head's matmul (`quant_linear.py`), choosing which tensors stay packed
(`quant_loading.py`), tensor-parallel vocabulary shards (`--quantization` refuses tp_size > 1).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from arborlm.runtime.models.gguf.dequant import SUPPORTED_TYPES, dequantize_into, row_bytes


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over packed GGUF rows `blocks` `[vocab, row bytes]` uint8 of `qtype`,
    returning embeddings in `dtype`."""

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, embedding_dim: int,
                 dtype: torch.dtype):
        super().__init__()
        block = GGML_QUANT_SIZES[qtype][0]
        if qtype not in SUPPORTED_TYPES or block == 1:
            raise ValueError(f"no packed embedding for GGUF type {qtype.name}")
        if embedding_dim % block or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != row_bytes(qtype, embedding_dim):
            raise ValueError(f"{qtype.name} rows of {embedding_dim} values are "
                             f"{embedding_dim // block * GGML_QUANT_SIZES[qtype][1]} bytes; got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        self.qtype, self.embedding_dim, self.dtype = qtype, embedding_dim, dtype
        self.num_embeddings = blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids `[...]` int -> `[..., embedding_dim]` in `dtype`; only those rows decoded."""
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=self.dtype)
        if flat.numel():
            rows = self.blocks.index_select(0, flat)  # [T, row bytes], bounds-checked
            dequantize_into(rows.numpy(), self.qtype, out)
        return out.reshape(*ids.shape, self.embedding_dim)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole table `[vocab, embedding_dim]` decoded (a fresh copy, for references)."""
        out = torch.empty(self.num_embeddings, self.embedding_dim, dtype=dtype or self.dtype)
        dequantize_into(self.blocks.numpy(), self.qtype, out)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name}, {self.dtype}"

"""Dequantizing GGUF tensor data into a torch tensor, a bounded chunk of rows at a time.

The block formats (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) are decoded by the `gguf` package's
vectorized numpy code (`gguf.quants.dequantize`), which the tests check against float64
references of ggml's formulas; F32, F16 and BF16 are widened exactly. Rows go through float32
in chunks of about `CHUNK_ELEMENTS` values and are cast into the output as they are decoded, so
a tensor is never held dequantized twice.

Not here: which tensors a file has, their names or layout (`tensors.py`). Types outside
`SUPPORTED_TYPES` (the IQ and ternary formats, Q2_K, Q3_K, ...) are refused by the caller.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

T = GGMLQuantizationType
SUPPORTED_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                             T.Q4_K, T.Q5_K, T.Q6_K})
CHUNK_ELEMENTS = 1 << 22  # values decoded per step: 16 MiB of float32 temporaries


def row_bytes(qtype: GGMLQuantizationType, row_elements: int) -> int:
    """Bytes one row of `row_elements` values takes in `qtype` (a whole number of blocks)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    assert row_elements % block == 0, (qtype.name, row_elements)
    return row_elements // block * type_size


def dequantize_into(raw: np.ndarray, qtype: GGMLQuantizationType, out: torch.Tensor) -> None:
    """Decode `raw` (GGUF data of `out.numel()` values in `qtype`, as `GGUFReader` maps it:
    typed for F32/F16, bytes otherwise) into `out` `[rows, cols]` (any float dtype)."""
    assert qtype in SUPPORTED_TYPES, qtype.name
    rows, cols = out.shape
    data = raw.reshape(-1).view(np.uint8).reshape(rows, row_bytes(qtype, cols))
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        chunk = data[start:start + step]
        values = _decode(chunk, qtype)  # [chunk rows, cols] float32, owned
        out[start:start + step].copy_(torch.from_numpy(values))


def _decode(chunk: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == T.F32:
        return np.array(chunk.view(np.float32))  # a copy: the file's pages are read-only
    if qtype == T.F16:
        return chunk.view(np.float16).astype(np.float32)
    return np.asarray(dequantize(chunk, qtype), dtype=np.float32)

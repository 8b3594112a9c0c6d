"""`QuantEmbedding`: looked-up rows of a packed GGUF table equal the float64 reference's rows.

Every block type the loader decodes, on random blocks whose f16 scales include zero, both f16
extremes and subnormals (`gguf_reference.random_blocks`). Each decoded value is one rounding of
the exact one, so float32 rows equal the float64 reference rounded to float32 exactly, and
bfloat16 rows equal those rounded again (the float loader's own path: decode to float32, cast).
Ids of any shape, repeated ids, an empty lookup, an id past the table refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from arborlm.runtime.platforms.cpu.quant_embedding import QuantEmbedding
from tests.runtime.gguf_reference import T, random_blocks, reference_dequantize

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
VOCAB = 40


def _table(qtype: T, dim: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random packed rows `[VOCAB, row bytes]` and their float64 values `[VOCAB, dim]`."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, VOCAB * dim // GGML_QUANT_SIZES[qtype][0], rng)
    raw = raw.reshape(VOCAB, -1)
    return torch.from_numpy(raw.copy()), reference_dequantize(raw, qtype)[0]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lookup_equals_the_float64_rows_rounded(qtype, dtype):
    dim = 2 * GGML_QUANT_SIZES[qtype][0]  # two blocks a row
    blocks, values = _table(qtype, dim, seed=int(qtype))
    embedding = QuantEmbedding(blocks, qtype, dim, dtype)
    ids = torch.tensor([[3, 0, 39, 3], [17, 17, 5, 22]])
    got = embedding(ids)
    assert got.shape == (2, 4, dim) and got.dtype == dtype
    want = torch.from_numpy(values[ids.numpy()].astype(np.float32)).to(dtype)
    assert torch.equal(got, want), (got - want).abs().max()
    whole = embedding.dequantized(torch.float32)
    assert torch.equal(whole, torch.from_numpy(values.astype(np.float32)))


def test_empty_and_out_of_range_lookups():
    blocks, _ = _table(T.Q8_0, 64, seed=1)
    embedding = QuantEmbedding(blocks, T.Q8_0, 64, torch.bfloat16)
    assert embedding(torch.zeros(0, dtype=torch.long)).shape == (0, 64)
    with pytest.raises(IndexError):
        embedding(torch.tensor([VOCAB]))


def test_misshapen_tables_are_refused():
    blocks, _ = _table(T.Q4_0, 64, seed=2)
    with pytest.raises(ValueError, match="bytes"):
        QuantEmbedding(blocks, T.Q4_0, 96, torch.float32)
    with pytest.raises(ValueError, match="no packed embedding"):
        QuantEmbedding(blocks, T.F16, 64, torch.float32)

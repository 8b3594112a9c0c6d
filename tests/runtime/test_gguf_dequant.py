"""GGUF dequantization (`models/gguf/dequant.py`) against float64 references of ggml's formats,
on random blocks with zero, extreme and subnormal scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from arborlm.runtime.models.gguf.dequant import SUPPORTED_TYPES, dequantize_into
from tests.runtime.gguf_reference import T, random_blocks, reference_dequantize

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
EPS32 = 2.0 ** -24


def _check(raw: np.ndarray, qtype: T, rows: int, cols: int) -> None:
    out = torch.empty(rows, cols, dtype=torch.float32)
    dequantize_into(raw, qtype, out)
    ref, magnitude = reference_dequantize(raw.reshape(rows, -1), qtype)
    got = out.double().numpy()
    error = np.abs(got - ref)
    bound = 4 * EPS32 * magnitude  # a few float32 roundings of the largest term
    worst = int(np.argmax(error - bound))
    assert np.all(error <= bound), (qtype.name, worst, got.flat[worst], ref.flat[worst])


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_formats_match_float64_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    cols = 512  # two K-quant super-blocks, sixteen 32-value blocks per row
    rows = 6
    blocks = random_blocks(qtype, rows * cols // GGML_QUANT_SIZES[qtype][0], rng)
    _check(blocks.reshape(rows, -1), qtype, rows, cols)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_formats_widen_exactly(qtype):
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 16, size=(4, 64), dtype=np.uint16)
    if qtype == T.F32:
        values = np.concatenate([rng.standard_normal((4, 32)).astype(np.float32),
                                 np.full((4, 32), 3.0e38, np.float32)], axis=1)
        raw = values.view(np.uint8)
    else:
        exponent_mask = 0x7C00 if qtype == T.F16 else 0x7F80
        bits[(bits & exponent_mask) == exponent_mask] &= ~np.uint16(0x4000)  # no inf / NaN
        raw = bits.view(np.uint8)
    out = torch.empty(4, 64, dtype=torch.float32)
    dequantize_into(raw, qtype, out)
    ref, _ = reference_dequantize(raw, qtype)
    assert np.array_equal(out.double().numpy(), ref)


def test_chunked_decode_into_bfloat16_equals_one_pass(monkeypatch):
    """Rows decoded in several chunks, cast into bfloat16, equal one float32 pass rounded."""
    import arborlm.runtime.models.gguf.dequant as dequant

    rng = np.random.default_rng(3)
    raw = random_blocks(T.Q4_K, 10 * 2, rng, scales=np.array([0.01, 0.5], np.float16))
    full = torch.empty(10, 512)
    dequantize_into(raw.reshape(10, -1), T.Q4_K, full)
    monkeypatch.setattr(dequant, "CHUNK_ELEMENTS", 3 * 512)
    chunked = torch.empty(10, 512, dtype=torch.bfloat16)
    dequantize_into(raw.reshape(10, -1), T.Q4_K, chunked)
    assert torch.equal(chunked, full.to(torch.bfloat16))


def test_supported_types_are_the_documented_ones():
    assert {t.name for t in SUPPORTED_TYPES} == {
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}

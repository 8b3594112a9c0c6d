"""Float64 references of ggml's block formats, written from ggml-quants.c's `dequantize_row_*`
loops (one block at a time, scalar indexing), and random blocks to feed them.

Each reference returns `(values, magnitude)`: the decoded values and, per value, the sum of the
absolute terms it was computed from, which bounds the rounding error of a float32 decoder.
Not the decoder under test (that is `arborlm.runtime.models.gguf.dequant`).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
QK_K = 256
# f16 scales the random blocks draw from: zero, both extremes, a subnormal, ordinary values.
EXTREME_SCALES = np.array([0.0, 65504.0, -65504.0, 6e-8, -6e-8, 1.0, 1e-3, -2.5],
                          dtype=np.float16)


def _f16(block: np.ndarray, offset: int) -> float:
    return float(block[offset:offset + 2].view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return ((int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4),
            (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4))


def _block(qtype: T, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.zeros(GGML_QUANT_SIZES[qtype][0])
    mag = np.zeros_like(y)
    if qtype == T.Q8_0:
        d = _f16(b, 0)
        q = b[2:34].view(np.int8).astype(np.float64)
        return d * q, np.abs(d * q)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        d = _f16(b, 0)
        m = _f16(b, 2) if qtype in (T.Q4_1, T.Q5_1) else 0.0
        at = {T.Q4_0: 2, T.Q4_1: 4, T.Q5_0: 6, T.Q5_1: 8}[qtype]
        qh = int(b[at - 4:at].view(np.uint32)[0]) if qtype in (T.Q5_0, T.Q5_1) else 0
        five = qtype in (T.Q5_0, T.Q5_1)
        offset = 0 if qtype in (T.Q4_1, T.Q5_1) else (16 if five else 8)
        for j in range(16):
            lo, hi = int(b[at + j]) & 0xF, int(b[at + j]) >> 4
            if five:
                lo |= ((qh >> j) << 4) & 0x10
                hi |= (qh >> (j + 12)) & 0x10
            for k, q in ((j, lo), (j + 16, hi)):
                y[k] = (q - offset) * d + m
                mag[k] = abs((q - offset) * d) + abs(m)
        return y, mag
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        scales = b[4:16]
        qh = b[16:48] if qtype == T.Q5_K else None
        qs = b[48:176] if qtype == T.Q5_K else b[16:144]
        for j in range(4):
            for half in range(2):
                sc, m = _scale_min_k4(2 * j + half, scales)
                for lane in range(32):
                    q = (int(qs[32 * j + lane]) >> (4 * half)) & 0xF
                    if qh is not None and int(qh[lane]) & (1 << (2 * j + half)):
                        q += 16
                    k = 64 * j + 32 * half + lane
                    y[k] = d * sc * q - dmin * m
                    mag[k] = abs(d * sc * q) + abs(dmin * m)
        return y, mag
    if qtype == T.Q6_K:
        ql, qh, sc = b[0:128], b[128:192], b[192:208].view(np.int8)
        d = _f16(b, 208)
        for n in range(2):
            for lane in range(32):
                h = int(qh[32 * n + lane])
                lo0, lo1 = int(ql[64 * n + lane]), int(ql[64 * n + lane + 32])
                qs = ((lo0 & 0xF) | ((h & 3) << 4), (lo1 & 0xF) | (((h >> 2) & 3) << 4),
                      (lo0 >> 4) | (((h >> 4) & 3) << 4), (lo1 >> 4) | (((h >> 6) & 3) << 4))
                for part, q in enumerate(qs):
                    k = 128 * n + 32 * part + lane
                    y[k] = d * int(sc[8 * n + lane // 16 + 2 * part]) * (q - 32)
                    mag[k] = abs(y[k])
        return y, mag
    raise AssertionError(qtype)


def reference_dequantize(raw: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """Decode `raw` `[rows, row bytes]` (uint8) of `qtype` -> float64 `[rows, cols]`, and the
    per-value magnitude bound."""
    if qtype == T.F32:
        values = raw.view(np.float32).astype(np.float64)
        return values, np.abs(values)
    if qtype == T.F16:
        values = raw.view(np.float16).astype(np.float64)
        return values, np.abs(values)
    if qtype == T.BF16:
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float64), np.abs(values.astype(np.float64))
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(-1, type_size)
    decoded = [_block(qtype, b) for b in blocks]
    rows = raw.shape[0]
    values = np.stack([v for v, _ in decoded]).reshape(rows, -1)
    mags = np.stack([m for _, m in decoded]).reshape(rows, -1)
    return values, mags


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator,
                  scales: np.ndarray = EXTREME_SCALES) -> np.ndarray:
    """`[n_blocks, type size]` uint8 blocks of random quants whose f16 scale fields are drawn
    from `scales` (so zero, extreme and subnormal scales all occur)."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    fields = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
              T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]
    for offset in fields:
        picked = rng.choice(scales, size=n_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = picked.view(np.uint8).reshape(n_blocks, 2)
    return blocks

"""Quantizing float weights to GGUF's Q4_K and Q6_K blocks in torch, as llama.cpp's reference does.

The `gguf` package writes only the 32-value types; these two are the K-quant mix of a Q4_K_M
file. Both follow ggml-quants.c's reference quantizers (`quantize_row_q4_K_ref`,
`quantize_row_q6_K_ref`) step for step, in float32, vectorized over every sub-block at once:

- Q4_K: 256-value super-blocks of eight 32-value sub-blocks, x ~ d * sc_j * q - dmin * m_j
  with q in 0..15 and 6-bit sc_j, m_j. Each sub-block's scale and minimum come from
  `make_qkx2_quants`: a search over 21 candidate scales, each refit by weighted least squares
  (weights |x| + rms(x)), keeping the smallest weighted error; then the super-block's f16 d and
  dmin quantize those to 6 bits, and the quants are recomputed from the rounded ones.
- Q6_K: sixteen 16-value sub-blocks, x ~ d * sc_j * (q - 32) with q in 0..63 and int8 sc_j.
  Each sub-block's scale comes from `make_qx_quants` (19 candidates around max|x| / -32, refit
  by least squares weighted by x^2).

Not here: the 32-value types (`quant_linear.quantize_weight`, the `gguf` package's), decoding
(`models/gguf/dequant.py`), choosing which linear gets which type (`quant_loading.py`).
"""

from __future__ import annotations

import torch

QK_K = 256
Q4_K_BYTES = 144
Q6_K_BYTES = 210


# Sub-blocks searched at a time: each candidate's temporaries (a few `[n, 32]` float32 tensors)
# then stay in L2 instead of streaming a whole table's worth through memory per candidate.
CHUNK = 8192


def _in_chunks(search, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`search` (`_qkx2` or `_qx`) over sub-blocks `x` `[n, size]`, `CHUNK` at a time: the same
    results, each sub-block's search being its own."""
    parts = [search(x[i:i + CHUNK]) for i in range(0, x.shape[0], CHUNK)]
    return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])


def _f16_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 `[n]` -> their f16 bit patterns as bytes `[n, 2]` (little-endian)."""
    return values.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _weighted_fit(x: torch.Tensor, w: torch.Tensor, lo: torch.Tensor, iscale: torch.Tensor,
                  nmax: int) -> tuple[torch.Tensor, ...]:
    """One `make_qkx2_quants` candidate: quants for `iscale`, their least-squares scale and
    minimum (the minimum capped at 0), and the weighted error. Shapes `[n, 32]` / `[n, 1]`."""
    q = torch.round(iscale * (x - lo)).clamp_(0, nmax)
    sum_w, sum_x = w.sum(-1, keepdim=True), (w * x).sum(-1, keepdim=True)
    sum_l, sum_l2 = (w * q).sum(-1, keepdim=True), (w * q * q).sum(-1, keepdim=True)
    sum_xl = (w * q * x).sum(-1, keepdim=True)
    det = sum_w * sum_l2 - sum_l * sum_l
    ok = det > 0
    safe = torch.where(ok, det, torch.ones_like(det))
    scale = (sum_w * sum_xl - sum_x * sum_l) / safe
    low = (sum_l2 * sum_x - sum_l * sum_xl) / safe
    positive = low > 0
    scale = torch.where(positive, sum_xl / sum_l2.clamp_min(1e-30), scale)
    low = torch.where(positive, torch.zeros_like(low), low)
    err = (w * (scale * q + low - x) ** 2).sum(-1, keepdim=True)
    return q, scale, low, err, ok


def _qkx2(x: torch.Tensor, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1,
          nstep: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_qkx2_quants` over sub-blocks x `[n, 32]`: (scale `[n]`, minus the minimum `[n]`),
    x ~ scale * q - that, q in 0..nmax."""
    w = x.abs() + (x * x).mean(-1, keepdim=True).sqrt()  # [n, 32]
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True)
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    iscale = nmax / span
    q = torch.round(iscale * (x - lo)).clamp_(0, nmax)
    scale, low = 1 / iscale, lo
    best = (w * (scale * q + low - x) ** 2).sum(-1, keepdim=True)
    for step in range(nstep + 1):  # ggml re-centres each candidate on the best minimum yet
        cur = torch.where(flat, torch.ones_like(hi), hi - low)
        cand = (rmin + rdelta * step + nmax) / cur
        _, c_scale, c_low, c_err, ok = _weighted_fit(x, w, low, cand, nmax)
        better = ok & (c_err < best)
        scale = torch.where(better, c_scale, scale)
        low = torch.where(better, c_low, low)
        best = torch.where(better, c_err, best)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    low = torch.where(flat, lo, low)
    return scale[:, 0], -low[:, 0]


def quantize_q4_k(weight: torch.Tensor) -> torch.Tensor:
    """A float weight `[rows, cols]` (cols a multiple of 256) -> Q4_K rows `[rows, cols / 256 *
    144]` uint8, as `quantize_row_q4_K_ref` writes them."""
    rows, cols = weight.shape
    assert cols % QK_K == 0, cols
    x = weight.detach().float().reshape(-1, 8, 32)  # [blocks, sub, 32]
    n = x.shape[0]
    scales, mins = _in_chunks(_qkx2, x.reshape(-1, 32))
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale, max_min = scales.amax(-1), mins.amax(-1)  # [n]
    inv_scale = torch.where(max_scale > 0, 63 / max_scale.clamp_min(1e-30), 0.0)
    inv_min = torch.where(max_min > 0, 63 / max_min.clamp_min(1e-30), 0.0)
    ls = torch.round(inv_scale[:, None] * scales).clamp_(0, 63).to(torch.uint8)  # [n, 8]
    lm = torch.round(inv_min[:, None] * mins).clamp_(0, 63).to(torch.uint8)
    d = (max_scale / 63).to(torch.float16)
    dmin = (max_min / 63).to(torch.float16)
    d_j = d.float()[:, None] * ls.float()  # [n, 8]
    m_j = dmin.float()[:, None] * lm.float()
    safe = torch.where(d_j == 0, torch.ones_like(d_j), d_j)
    q = torch.round((x + m_j[..., None]) / safe[..., None]).clamp_(0, 15)
    q = torch.where(d_j[..., None] == 0, torch.zeros_like(q), q).to(torch.uint8)  # [n, 8, 32]
    packed = torch.empty(n, 12, dtype=torch.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # sub 2i low, 2i + 1 high nibbles
    out = torch.cat([_f16_bytes(d.float()), _f16_bytes(dmin.float()), packed, qs], dim=1)
    return out.reshape(rows, cols // QK_K * Q4_K_BYTES)


def _qx(x: torch.Tensor, nmax: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_qx_quants` with rmse_type 1 over sub-blocks x `[n, 16]`: (scale `[n]`, quants
    `[n, 16]` in -nmax..nmax-1), x ~ scale * q."""
    idx = x.abs().argmax(-1, keepdim=True)
    peak = x.gather(-1, idx)  # [n, 1], signed
    tiny = peak.abs() < 1e-15
    safe = torch.where(tiny, torch.ones_like(peak), peak)
    w = x * x

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.round(iscale * x).clamp_(-nmax, nmax - 1)
        return q, (w * x * q).sum(-1, keepdim=True), (w * q * q).sum(-1, keepdim=True)

    q, sumlx, suml2 = fit(-nmax / safe)
    scale = torch.where(suml2 > 0, sumlx / suml2.clamp_min(1e-30), torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        c_q, c_lx, c_l2 = fit(-(nmax + 0.1 * step) / safe)
        better = (c_l2 > 0) & (c_lx * c_lx > best * c_l2)
        c_scale = c_lx / c_l2.clamp_min(1e-30)
        q = torch.where(better, c_q, q)
        scale = torch.where(better, c_scale, scale)
        best = torch.where(better, c_scale * c_lx, best)
    scale = torch.where(tiny, torch.zeros_like(scale), scale)
    return scale[:, 0], torch.where(tiny, torch.zeros_like(q), q)


def quantize_q6_k(weight: torch.Tensor) -> torch.Tensor:
    """A float weight `[rows, cols]` (cols a multiple of 256) -> Q6_K rows `[rows, cols / 256 *
    210]` uint8, as `quantize_row_q6_K_ref` writes them."""
    rows, cols = weight.shape
    assert cols % QK_K == 0, cols
    x = weight.detach().float().reshape(-1, 16, 16)  # [blocks, sub, 16]
    n = x.shape[0]
    scales, _ = _in_chunks(_qx, x.reshape(-1, 16))
    scales = scales.reshape(n, 16)
    pick = scales.abs().argmax(-1, keepdim=True)
    max_scale = scales.gather(-1, pick)[:, 0]  # [n], signed
    zero = max_scale.abs() < 1e-15
    iscale = torch.where(zero, 0.0, -128 / torch.where(zero, 1.0, max_scale))
    d = torch.where(zero, 0.0, 1 / torch.where(zero, 1.0, iscale)).to(torch.float16)
    sc = torch.round(iscale[:, None] * scales).clamp_(max=127).to(torch.int8)  # [n, 16]
    d_j = d.float()[:, None] * sc.float()
    safe = torch.where(d_j == 0, torch.ones_like(d_j), d_j)
    q = torch.round(x / safe[..., None]).clamp_(-32, 31) + 32
    q = torch.where(d_j[..., None] == 0, torch.full_like(q, 32), q)
    q = q.to(torch.uint8).reshape(n, 2, 4, 32)  # [n, half, k, l]: value 128 half + 32 k + l
    ql = ((q[:, :, [0, 1]] & 0xF) | ((q[:, :, [2, 3]] & 0xF) << 4)).reshape(n, 2, 64)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6))  # [n, half, 32]
    out = torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(torch.uint8),
                     _f16_bytes(d.float())], dim=1)
    return out.reshape(rows, cols // QK_K * Q6_K_BYTES)

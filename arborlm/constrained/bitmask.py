"""Packed token bitmasks: one int32 row of ceil(vocab/32) words per request, bit i = token i.

The decode loop allocates one `[batch, ceil(V/32)]` mask per step, lets each grammar request's
matcher fill its row on the CPU, and calls `apply_token_bitmask_` on the logits before sampling:
masked tokens become -inf, rows without a grammar stay untouched, and logits columns past the
mask (a model vocabulary padded beyond the grammar's) are masked too.

On CPU, float32 logits (what the decode loop samples from) go to ArborLM's C++ kernel
(`cpu_kernels.apply_token_bitmask`: one masked store per 16 logits), where the operators are
built. Otherwise the bits are unpacked with numpy and -inf is written through an integer view of
each row (`np.copyto(..., where=bit == 0)`), which costs the same for any mask. Both are faster
than a plain torch unpack and than xgrammar's `apply_token_bitmask_inplace` CPU kernel, which
skips words whose 32 tokens are all allowed but walks the bits of every other word (real masks
are either nearly all masked or allowed with scattered holes, so most words get walked);
`benchmarks/grammar_engines.py` compares them (figures in docs/performance.md). On a GPU the
mask is copied over and xgrammar's GPU kernel applies it.
This module does not fill masks; matchers do.
"""

from __future__ import annotations

import numpy as np
import torch

# -inf as raw bits, written through an integer view so the numpy path serves every dtype.
_NEG_INF_BITS = {
    torch.float32: (torch.int32, np.array(0xFF800000, dtype=np.uint32).view(np.int32)),
    torch.bfloat16: (torch.int16, np.array(0xFF80, dtype=np.uint16).view(np.int16)),
    torch.float16: (torch.int16, np.array(0xFC00, dtype=np.uint16).view(np.int16)),
}


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A `[batch, ceil(vocab_size/32)]` int32 CPU mask, all tokens allowed (-1 = all bits)."""
    return torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor | list[int] | None = None) -> None:
    """Set `logits[r, t] = -inf` where bit t of `bitmask[r]` is 0, for each r in `rows`.

    logits: [B, V'] float32/bfloat16/float16 (CPU or GPU); bitmask: [B, W] int32 on CPU,
    W*32 >= the grammar vocabulary. `rows=None` means every row. Columns >= W*32 of the given
    rows are masked as well. Other rows are not touched.
    """
    assert logits.dim() == 2 and bitmask.dim() == 2 and bitmask.dtype == torch.int32
    assert logits.shape[0] == bitmask.shape[0], (logits.shape, bitmask.shape)
    row_list = list(range(logits.shape[0])) if rows is None else [int(r) for r in rows]
    if not row_list:
        return
    if not logits.is_contiguous():  # both kernels assume a dense row-major layout
        dense = logits.contiguous()
        apply_token_bitmask_(dense, bitmask, row_list)
        logits.copy_(dense)
        return
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    if logits.shape[1] > covered:
        logits[row_list, covered:] = float("-inf")
    if logits.device.type != "cpu":
        import xgrammar as xgr

        device_mask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=covered,
                                        indices=row_list)
    elif logits.dtype == torch.float32 and bitmask.is_contiguous() and _kernel_available():
        from arborlm.runtime.platforms.cpu import kernels

        kernels.apply_token_bitmask(logits, bitmask, row_list, covered)
    elif logits.dtype in _NEG_INF_BITS:
        _apply_numpy(logits, bitmask, row_list, covered)
    else:
        _apply_torch(logits, bitmask, row_list, covered)


def _kernel_available() -> bool:
    from arborlm.runtime.platforms.cpu import kernels

    return kernels.token_bitmask_available()


def _apply_numpy(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                 covered: int) -> None:
    int_dtype, neg_inf = _NEG_INF_BITS[logits.dtype]
    raw = logits.view(int_dtype).numpy()  # [B, V'] same memory, as integers
    packed = bitmask.numpy().view(np.uint8)  # [B, 4W] little-endian bytes
    for r in rows:
        allowed = np.unpackbits(packed[r], bitorder="little")[:covered]  # [covered] 0/1
        np.copyto(raw[r, :covered], neg_inf, where=allowed == 0)


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                 covered: int) -> None:
    """Any other dtype (float64): unpack with torch ops."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[rows].unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    blocked = bits.flatten(1)[:, :covered] == 0  # [R, covered]
    index = torch.tensor(rows)
    logits[index, :covered] = logits[index, :covered].masked_fill(blocked, float("-inf"))

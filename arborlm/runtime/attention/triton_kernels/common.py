"""What the Triton attention kernels share: interpreter detection and the tile product.

`INTERPRET` is read once, when this package is first imported, because Triton decides at
decoration time whether a `@triton.jit` function is compiled for the GPU or run by its CPU
interpreter (`TRITON_INTERPRET=1`). Block sizes elsewhere are picked from it: small tiles keep
the interpreter fast, larger ones keep the GPU busy.

This module holds no kernels of its own beyond the `_dot` helper.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_f32_dot(dtype: torch.dtype) -> bool:
    """Whether tile products must run in float32.

    Always for float32 inputs (so that the GPU does not silently use TF32), and always under the
    interpreter, whose bfloat16 `tl.dot` multiplies the raw uint16 storage instead of the values.
    """
    return INTERPRET or dtype == torch.float32


def head_block(head_dim: int) -> int:
    """Power-of-two tile width covering `head_dim` (at least 16, the smallest GPU dot size)."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """`a @ b` accumulated in float32; with F32 the inputs are upcast and multiplied exactly."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out

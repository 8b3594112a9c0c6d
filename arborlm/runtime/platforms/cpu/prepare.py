"""Getting a loaded model ready to run on a CPU: allocator tuning, packed weights, huge pages,
and whether deterministic inference can hold.

`ModelRunner` calls these once, in order, when its device is a CPU; nothing here runs a step.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.huge_pages import HugePageArena, move_decode_weights
from arborlm.runtime.platforms.cpu.linear import pack_linears

logger = logging.getLogger(__name__)

# glibc malloc serves blocks above its mmap threshold (128 KiB at first) with fresh mappings, so
# each step's activations and KV gathers would page-fault their memory in anew, and free() trims
# the heap back. Raising both limits keeps that memory in the process: on CPU a step's large
# temporaries then cost what their arithmetic costs, not their page faults.
_MALLOC_MMAP_THRESHOLD = 256 << 20
_MALLOC_TRIM_THRESHOLD = 1 << 30


def keep_cpu_allocations() -> bool:
    """Make glibc keep freed large blocks for reuse (see above); False where it is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        return bool(libc.mallopt(m_mmap_threshold, _MALLOC_MMAP_THRESHOLD)
                    and libc.mallopt(m_trim_threshold, _MALLOC_TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


def deterministic_kernels_missing(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                  head_dim: int) -> str | None:
    """Why deterministic inference cannot hold for a model of this dtype and head shape here
    (the batch-invariant kernels it needs are missing or do not take the heads), or None."""
    if not (cpu_kernels.available(dtype) and cpu_kernels.elementwise_available(dtype)):
        return f"ArborLM's CPU kernels for {dtype} are not available here"
    if not cpu_kernels.attention_fits(dtype, num_heads // num_kv_heads, head_dim):
        return (f"its attention kernel does not take {num_heads // num_kv_heads} "
                f"query heads per KV head of dimension {head_dim}")
    return None


def prepare_weights(model: nn.Module, *, compiled: bool,
                    deterministic: bool) -> HugePageArena | None:
    """Pack the model's linears (`linear.pack_linears`; panels alone when `deterministic`; float32
    copies left untransposed for a `compiled` step) and move the weights every decode step
    streams onto huge pages; returns the arena that keeps their mapping alive, if any."""
    packed = pack_linears(model, transpose_fp32=not compiled, panels_only=deterministic)
    logger.info("%d linear weights prepacked (%s)", packed,
                "panels, every batch size" if deterministic else "oneDNN")
    return move_decode_weights(model)

"""Weights that decode streams every step, on transparent huge pages (CPU, Linux).

A batch-1 decode step reads every linear weight once, front to back, so its speed is the rate
at which memory streams in. With 4 KiB pages that stream crosses a page, and so a TLB entry,
every 64 cache lines; the page walks then cost a share of the bandwidth. Linux backs anonymous
memory with 2 MiB pages where a mapping asks for them (`MADV_HUGEPAGE`; `transparent_hugepage`
set to `madvise`, the common default, gives them to no one else), but torch's allocator never
asks. `HugePageArena` is one such mapping, and `move_decode_weights` copies into it the weights
that ArborLM's decode kernels stream (each `PackedLinear`'s panels, `kernels.panel_linear`; the
GGUF blocks of each `QuantLinear` and `QuantEmbedding`, `kernels.quant_linear`), which makes
one-row products measurably faster (docs/performance.md, "CPU kernels" and "Packed GGUF
weights against llama.cpp").

Where the kernel has no huge pages (`never`, or not Linux), the arena is plain memory and changes
nothing; `ARBORLM_HUGE_PAGES=0` skips it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: every tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_possible() -> bool:
    """Whether this kernel can back a mapping that asks with huge pages."""
    if os.environ.get("ARBORLM_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


class HugePageArena:
    """One private anonymous mapping, 2 MiB-aligned and advised `MADV_HUGEPAGE`, handed out in
    64-byte-aligned tensors. It lives as long as the arena object (keep a reference)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults get 2 MiB
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        start = (-whole.data_ptr()) % HUGE_PAGE
        self.bytes = whole[start:start + nbytes]
        self.used = 0

    @property
    def address(self) -> int:
        return self.bytes.data_ptr()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `t` in the arena."""
        n = t.numel() * t.element_size()
        if self.used + n > self.nbytes:
            raise ValueError(f"arena full: {n} bytes wanted, {self.nbytes - self.used} left")
        out = self.bytes[self.used:self.used + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self.used += -(-n // ALIGN) * ALIGN
        return out


def decode_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The (module, attribute) of every CPU tensor a decode step streams: each `PackedLinear`'s
    panels, each `QuantLinear`'s and `QuantEmbedding`'s packed blocks (a tied head's blocks are
    its embedding's tensor: both are listed)."""
    from arborlm.runtime.platforms.cpu.linear import PackedLinear
    from arborlm.runtime.platforms.cpu.quant_embedding import QuantEmbedding
    from arborlm.runtime.platforms.cpu.quant_linear import QuantLinear

    found = []
    for m in model.modules():
        name = "panels" if isinstance(m, PackedLinear) else \
            "blocks" if isinstance(m, QuantLinear | QuantEmbedding) else None
        t = getattr(m, name) if name is not None else None
        if t is not None and t.device.type == "cpu":
            found.append((m, name))
    return found


def move_decode_weights(model: nn.Module) -> HugePageArena | None:
    """Copy the weights a decode step streams (`decode_weights`) into a new `HugePageArena`,
    each tensor once however many modules share it; returns the arena (to keep), or None when
    there is nothing to move or no huge pages here."""
    found = decode_weights(model)
    if not found or not huge_pages_possible():
        return None
    unique: dict[tuple[int, int], torch.Tensor] = {}
    for m, name in found:
        t = getattr(m, name)
        unique.setdefault((t.data_ptr(), t.numel() * t.element_size()), t)
    total = sum(-(-n // ALIGN) * ALIGN for _, n in unique)
    arena = HugePageArena(total)
    moved = {key: arena.copy(t) for key, t in unique.items()}
    for m, name in found:
        t = getattr(m, name)
        setattr(m, name, moved[(t.data_ptr(), t.numel() * t.element_size())])
    del unique
    _release_freed_memory()  # the weights' old copies (the allocator would keep them)
    logger.info("%d weights (%.0f MB) on transparent huge pages", len(moved), total / 2**20)
    return arena


def _release_freed_memory() -> None:
    """Return the heap's free memory to the system once (`malloc_trim`; glibc only)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

"""Weights on transparent huge pages (`layers/huge_pages.py`).

The arena is one mapping advised `MADV_HUGEPAGE` (its `hg` flag in /proc/self/smaps), hands out
64-byte-aligned copies equal to their sources, and refuses to overflow; `move_decode_weights`
moves every `PackedLinear`'s panels into it and the layers' products are unchanged;
`ARBORLM_HUGE_PAGES=0` leaves the model alone. (Whether the kernel then backs the mapping with
2 MiB pages depends on free memory, so it is not asserted.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from arborlm.runtime.platforms.cpu import huge_pages
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu import linear as cpu_linear

pytestmark = pytest.mark.skipif(not huge_pages.huge_pages_possible(),
                                reason="no transparent huge pages on this machine")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
    assert flags is not None, "no mapping holds the arena"
    return flags


def test_arena_copies_aligned_and_advised():
    arena = huge_pages.HugePageArena(3 << 20)
    assert arena.address % huge_pages.HUGE_PAGE == 0
    assert "hg" in _vm_flags(arena.address)
    a = torch.randn(100, 7)
    b = torch.randn(33).bfloat16()
    ca, cb = arena.copy(a), arena.copy(b)
    assert torch.equal(ca, a) and torch.equal(cb, b)
    assert ca.data_ptr() % 64 == 0 and cb.data_ptr() % 64 == 0
    assert cb.data_ptr() - ca.data_ptr() == -(-a.numel() * 4 // 64) * 64
    with pytest.raises(ValueError, match="arena full"):
        arena.copy(torch.empty(1 << 20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_weights_move_and_keep_their_products(dtype, monkeypatch):
    if not (cpu_linear.packing_available(dtype) and cpu_kernels.available(dtype)):
        pytest.skip("no packed linears or no panel kernel here")
    monkeypatch.setattr(cpu_linear, "MIN_PACKED_ELEMENTS", 0)
    torch.manual_seed(0)
    holder = nn.ModuleDict({"mlp": nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))})
    holder = holder.to(dtype)
    cpu_linear.pack_linears(holder)
    x = torch.randn(3, 64).to(dtype)
    with torch.inference_mode():
        before = holder["mlp"](x)
    arena = huge_pages.move_decode_weights(holder)
    assert arena is not None
    lo, hi = arena.address, arena.address + arena.nbytes
    packed = [m for m in holder.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert len(packed) == 2
    for m in packed:
        assert lo <= m.panels.data_ptr() < hi
    with torch.inference_mode():
        assert torch.equal(holder["mlp"](x), before)

    monkeypatch.setenv("ARBORLM_HUGE_PAGES", "0")
    assert huge_pages.move_decode_weights(holder) is None

"""Weights on transparent huge pages (`layers/huge_pages.py`).

The arena is one mapping advised `MADV_HUGEPAGE` (its `hg` flag in /proc/self/smaps), hands out
64-byte-aligned copies equal to their sources, and refuses to overflow; `move_decode_weights`
moves every `PackedLinear`'s panels and every packed GGUF table (`QuantLinear`, `QuantEmbedding`;
a tied pair's one table once) into it and the layers' products are unchanged;
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


def test_packed_gguf_weights_move_once_and_keep_their_products():
    """`--quantization`'s tables: two linears and an embedding whose table a tied head shares.
    Each table is copied once (the pair still shares one), and every product and lookup is
    unchanged."""
    from gguf import GGMLQuantizationType as T

    from arborlm.runtime.platforms.cpu.quant_embedding import QuantEmbedding
    from arborlm.runtime.platforms.cpu.quant_linear import QuantLinear
    from arborlm.runtime.platforms.cpu.quant_loading import quantize_weight

    if not cpu_kernels.quant_linear_available():
        pytest.skip("quant_linear did not build")
    torch.manual_seed(0)
    table = quantize_weight(torch.randn(100, 64), T.Q8_0)
    holder = nn.ModuleDict({
        "embed": QuantEmbedding(table, T.Q8_0, 64, torch.float32),
        "up": QuantLinear(quantize_weight(torch.randn(96, 64), T.Q4_0), T.Q4_0, 64),
        "down": QuantLinear(quantize_weight(torch.randn(64, 96), T.Q4_1), T.Q4_1, 96,
                            bias=torch.randn(64)),
        "head": QuantLinear(table, T.Q8_0, 64),
    })
    assert holder["head"].blocks.data_ptr() == holder["embed"].blocks.data_ptr()
    ids, x = torch.tensor([3, 99, 0]), torch.randn(3, 64)

    def outputs():
        with torch.inference_mode():
            return [holder["embed"](ids), holder["down"](holder["up"](x)), holder["head"](x)]

    before = outputs()
    arena = huge_pages.move_decode_weights(holder)
    assert arena is not None
    lo, hi = arena.address, arena.address + arena.nbytes
    for name in ("embed", "up", "down", "head"):
        assert lo <= holder[name].blocks.data_ptr() < hi
    assert holder["head"].blocks.data_ptr() == holder["embed"].blocks.data_ptr()
    sizes = [holder[n].blocks.numel() for n in ("embed", "up", "down")]
    assert arena.used == sum(-(-n // 64) * 64 for n in sizes)
    for got, want in zip(outputs(), before):
        assert torch.equal(got, want)

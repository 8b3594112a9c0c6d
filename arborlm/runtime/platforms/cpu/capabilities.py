"""What this CPU can run: its instruction sets, read once per process.

ArborLM's CPU kernels need AVX-512 (and AVX512-BF16 for bfloat16 products); the operating
system must grant them too, which torch's checks include. The answers never change while a
process runs, so they are computed once and cached. Nothing here builds or imports a kernel:
the API process asks these questions too (to resolve the engine's defaults) without loading
any.
"""

from __future__ import annotations

import functools
import platform

import torch


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no such file)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes in bfloat16 natively (x86 AVX512-BF16 or AMX-BF16), which makes
    bfloat16 matmuls about twice as fast as float32 and halves the weight and KV traffic."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


@functools.cache
def kernel_instructions(dtype: torch.dtype) -> bool:
    """Whether this CPU (and its OS) grants what ArborLM's CPU kernels need for `dtype`: x86-64
    with AVX-512, and its BF16 dot product for bfloat16."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if not torch.cpu._is_avx512_supported():
        return False
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported()
    return dtype == torch.float32


def is_x86_64() -> bool:
    """Whether this is an x86-64 machine (the C++ operators are built for no other)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def has_avx512_vnni() -> bool:
    """Whether this CPU (and its OS) grants AVX-512 (F, BW, VL) with its VNNI int8 dot product:
    what `quant_linear`'s integer path needs."""
    flags = cpu_flags()
    return (is_x86_64() and torch.cpu._is_avx512_supported()
            and {"avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"} <= flags)


@functools.cache
def has_avx2_fma() -> bool:
    """Whether this CPU (and its OS) grants AVX2 with FMA and F16C: what `quant_linear`'s
    "avx2" path needs (AMD Zen 2/3 and Intel client cores have it, not AVX-512)."""
    return is_x86_64() and torch.cpu._is_avx2_supported() \
        and {"avx2", "fma", "f16c"} <= cpu_flags()


@functools.cache
def has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles with bfloat16 products and the OS grants them (torch asks
    for the tile state, as oneDNN does): where oneDNN's bfloat16 GEMMs run on AMX."""
    return (is_x86_64() and "amx_bf16" in cpu_flags() and torch.cpu._is_amx_tile_supported()
            and torch.cpu._init_amx())


@functools.cache
def has_avx512_quant_float() -> bool:
    """Whether this CPU (and its OS) grants AVX-512 (F, BW, VL) with F16C and FMA: what
    `quant_linear`'s float path needs (bfloat16 products also need `has_native_bf16`; without
    it, bfloat16 activations are widened to float32)."""
    return (is_x86_64() and torch.cpu._is_avx512_supported()
            and {"avx512bw", "avx512vl", "f16c", "fma"} <= cpu_flags())

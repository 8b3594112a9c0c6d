"""`row_gemv`: ArborLM's own one-row linear kernel for CPU decoding at batch 1.

A batch-1 decode step reads every weight once to produce one row, so it runs at the memory
bandwidth the linears reach. The library kernels fall short there: on a 2-core AVX512-BF16
machine, the 32M benchmark model's weights (one step's linears, 111 MB float32) take 10.5 ms
through MKL's GEMV (10.5 GB/s), 5.8 ms as Inductor's fused reduction (`row_linear`, one
thread), and 3.5 ms through `row_gemv` (32 GB/s) on two threads. `csrc/row_gemv.cpp` streams
each weight row front to back with four accumulators and splits the rows over torch's threads;
bfloat16 uses the AVX512-BF16 dot product (products exact, sums in float32, one rounding).

The kernel is a C++ torch operator, `torch.ops.arborlm.row_gemv`, built on first use with
torch's extension builder (a C++ compiler and ninja; ~20 s, cached on disk after) and traced by
`torch.compile` as an opaque call. `available(dtype)` says whether it can run here: an x86 CPU
with AVX-512 (and AVX512-BF16 for bfloat16), and a build that succeeded; otherwise callers keep
their library path. `ARBORLM_CPU_KERNELS=0` turns it off (to compare).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "row_gemv.cpp"
# Changing the source rebuilds on its own (the builder hashes it); the name is the cache entry.
EXTENSION_NAME = "arborlm_cpu_kernels"

_lock = threading.Lock()
_built: bool | None = None  # None: not tried yet; else whether the operator is registered


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU has the instructions `row_gemv` needs for `dtype`."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if not torch.cpu._is_avx512_supported():
        return False
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported()
    return dtype == torch.float32


def available(dtype: torch.dtype) -> bool:
    """Whether `row_gemv` runs here for `dtype`, building the operator on the first call."""
    if os.environ.get("ARBORLM_CPU_KERNELS", "1") == "0" or not cpu_supports(dtype):
        return False
    return _build()


def _build() -> bool:
    global _built
    with _lock:
        if _built is not None:
            return _built
        try:
            from torch.utils.cpp_extension import load

            _find_ninja()
            logger.info("loading ArborLM's CPU kernels (compiled on first use, ~20 s; cached)")
            load(EXTENSION_NAME, [str(SOURCE)], extra_cflags=["-O3", "-fopenmp"],
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        except Exception as exc:  # no compiler, no ninja, a read-only cache: keep the library path
            logger.warning("ArborLM's CPU kernels could not be built (%s); one-row linears use "
                           "the library kernels", exc)
            _built = False
            return False
        torch.library.register_fake("arborlm::row_gemv")(_row_gemv_shape)
        _built = True
        return True


def _find_ninja() -> None:
    """Put the `ninja` package's binary on PATH when none is there (a virtualenv not activated:
    torch's builder runs `ninja` by name)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _row_gemv_shape(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((1, weight.shape[0]))


def row_gemv(x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x `[1, in]` times weight `[out, in]` (plus bias `[out]`) -> `[1, out]` in x's dtype
    (float32 or bfloat16, the same for both), summed in float32 and rounded once;
    `available(x.dtype)` must hold."""
    return torch.ops.arborlm.row_gemv(x, weight, bias)

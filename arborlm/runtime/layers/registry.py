"""`ops_for`: the elementwise operator table layers call, chosen once per device and dtype.

A platform's kernels where they run (`arborlm.runtime.platforms.cpu.ops`), else PyTorch's forms
(`layers.ops.LayerOps`).
"""

from __future__ import annotations

import functools
import os

import torch

from arborlm.runtime.layers.ops import TORCH_OPS, LayerOps


def ops_for(device: torch.device | str, dtype: torch.dtype) -> LayerOps:
    """The elementwise operators for tensors of `dtype` on `device`: a platform's kernels where
    they run, else PyTorch's (`LayerOps`). Decided once per device type and dtype (and value of
    `ARBORLM_CPU_KERNELS`, which turns ArborLM's CPU kernels off)."""
    return _ops(torch.device(device).type, dtype, os.environ.get("ARBORLM_CPU_KERNELS", "1"))


@functools.cache
def _ops(device_type: str, dtype: torch.dtype, cpu_kernels_on: str) -> LayerOps:
    if device_type == "cpu" and cpu_kernels_on != "0":
        from arborlm.runtime.platforms.cpu import kernels

        if kernels.elementwise_available(dtype):
            from arborlm.runtime.platforms.cpu.ops import CpuKernelOps

            return CpuKernelOps()
    return TORCH_OPS

"""`ops_for`: the elementwise operator table layers call, chosen once per device and dtype.

A platform's kernels where they run (`arborlm.runtime.platforms.cpu.ops`), else PyTorch's forms
(`layers.ops.LayerOps`).
"""

from __future__ import annotations

import os

import torch

from arborlm.runtime.layers.ops import TORCH_OPS, LayerOps


def ops_for(device: torch.device, dtype: torch.dtype) -> LayerOps:
    """The elementwise operators for tensors of `dtype` on `device`: a platform's kernels where
    they run, else PyTorch's (`LayerOps`). Decided on the first call for each device and dtype
    (`ARBORLM_CPU_KERNELS=0` in the environment by then turns ArborLM's CPU kernels off)."""
    try:
        return _TABLES[device, dtype]
    except KeyError:
        table = _TABLES[device, dtype] = _choose(torch.device(device).type, dtype)
        return table


_TABLES: dict[tuple[torch.device, torch.dtype], LayerOps] = {}


def _choose(device_type: str, dtype: torch.dtype) -> LayerOps:
    if device_type == "cpu" and os.environ.get("ARBORLM_CPU_KERNELS", "1") != "0":
        from arborlm.runtime.platforms.cpu import kernels

        if kernels.elementwise_available(dtype):
            from arborlm.runtime.platforms.cpu.ops import CpuKernelOps

            return CpuKernelOps()
    return TORCH_OPS

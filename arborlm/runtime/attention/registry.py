"""`create_attention_backend`: the attention backends by name, imported when created.

`torch_native` (the reference; on a CPU served by `arborlm.runtime.platforms.cpu.attention`),
`triton` and `flashinfer`; so `import arborlm` never pulls Triton or FlashInfer. The registry is a
module of its own, not the package's `__init__`: a backend outside this package imports
`attention.base`, which runs the package's `__init__`, and a registry there would close an import
cycle through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arborlm.runtime.attention.base import AttentionBackend


def create_attention_backend(name: str, device: str,
                             deterministic: bool = False) -> AttentionBackend:
    """The backend `name` for a model runner on `device`; one instance serves one runner (the
    CPU backend keeps state between steps). `deterministic` (torch_native on a CPU only):
    batch-invariant attention."""
    if name == "torch_native":
        if device == "cpu":
            from arborlm.runtime.platforms.cpu.attention import CpuAttentionBackend

            return CpuAttentionBackend(deterministic=deterministic)
        if deterministic:
            raise ValueError(f"the torch_native attention backend has no deterministic mode "
                             f"on {device}")
        from arborlm.runtime.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend()
    if deterministic:
        raise ValueError(f"the {name} attention backend has no deterministic mode")
    if name == "triton":
        from arborlm.runtime.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "flashinfer":
        from arborlm.runtime.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    raise ValueError(f"unknown attention backend {name!r}")

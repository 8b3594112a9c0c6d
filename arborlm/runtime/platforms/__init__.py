"""Platform code: what runs only on one kind of device, reached through registries.

`cpu/` holds everything CPU-specific (ArborLM's C++ kernels and their build, CPU linears,
the CPU attention backend with its decode workspace and cascade, the fused and compiled decode
steps, huge pages and allocator tuning); `cuda/` the CUDA-graph decode executor. Generic code
reaches a platform through a registry: `choose_decode_executor` here,
`arborlm.runtime.layers.ops_for` (the layers' elementwise operators) and
`arborlm.runtime.attention.create_attention_backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arborlm.runtime.decode_executor import DecodeExecutor, DecodeParts


def choose_decode_executor(parts: DecodeParts) -> DecodeExecutor:
    """The first decode executor that applies (the order is `arborlm.runtime.decode_executor`'s);
    the candidates log why they do not where that is worth knowing."""
    from arborlm.runtime.decode_executor import EagerDecode
    from arborlm.runtime.platforms.cuda.graph_runner import create_cuda_graph_runner

    graphs = create_cuda_graph_runner(parts)
    if graphs is not None:
        return graphs
    if parts.device == "cpu":
        from arborlm.runtime.platforms.cpu import compiled_decode, fused_decode

        fused = fused_decode.create_fused_decode(parts)
        if fused is not None:
            return fused
        compiled = compiled_decode.create_compiled_decode(parts)
        if compiled is not None:
            return compiled
    return EagerDecode()

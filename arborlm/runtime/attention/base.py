"""The attention-backend interface.

A backend is created once per model runner. Before each forward step the runner calls
`init_forward_metadata(batch)`; each attention layer then calls `forward(q, k, v, layer, batch)`,
which stores the new tokens' K/V in the pool at `batch.out_cache_loc` and returns the attention
output. Backends differ only in how they compute; the KV layout (`KVPool`, `req_to_token`) is
shared, so a model never knows which backend runs it.

Decode steps can also be replayed from CUDA graphs
(`arborlm.runtime.platforms.cuda.graph_runner`). A backend that supports this returns None from
`cuda_graph_unsupported_reason` and implements the three `*cuda_graph*` / `*_capture` /
`*_replay` hooks, which keep the decode metadata in buffers allocated once, so that a captured
step reads this step's values at the captured addresses. The defaults say "unsupported", and the
runner then decodes eagerly with this backend.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from arborlm.runtime.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static facts about one attention layer."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


@dataclass(frozen=True)
class CudaGraphShape:
    """What a backend sizes its CUDA-graph buffers for."""

    max_bs: int  # largest captured decode batch, padding rows included
    max_context_len: int  # longest sequence a request can reach (req_to_token row width)
    layer: AttentionLayerSpec  # the attention shape every layer shares (layer_id unused)
    kv_dtype: torch.dtype
    device: torch.device


class AttentionBackend(abc.ABC):
    """Base class; subclasses implement `forward_extend` and `forward_decode`."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:  # noqa: B027 (optional hook)
        """Precompute whatever the layers of this step share (index tensors, masks, plans)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        """q `[T, H*D]`, k/v `[T, Hkv*D]` -> attention output `[T, H*D]`."""
        q = q.view(-1, layer.num_heads, layer.head_dim)
        k = k.view(-1, layer.num_kv_heads, layer.head_dim)
        v = v.view(-1, layer.num_kv_heads, layer.head_dim)
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.mode.is_decode:
            out = self.forward_decode(q, layer, batch)
        else:
            out = self.forward_extend(q, layer, batch)
        return out.reshape(-1, layer.num_heads * layer.head_dim)

    @abc.abstractmethod
    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        """q `[T, H, D]` for the new tokens; K/V of prefix + new tokens are in the pool."""

    @abc.abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        """q `[B, H, D]`, one token per request; its K/V is already in the pool."""

    def cuda_graph_unsupported_reason(self, kv_dtype: torch.dtype) -> str | None:
        """None when decode steps over a KV pool of `kv_dtype` can be captured in CUDA graphs;
        otherwise the reason they cannot (the model runner logs it and decodes eagerly)."""
        return f"the {type(self).__name__} attention backend has no CUDA-graph decode path"

    def init_cuda_graph_state(self, shape: CudaGraphShape) -> None:
        """Allocate, once, the buffers every captured decode step reads its metadata from."""
        raise NotImplementedError(self.cuda_graph_unsupported_reason(shape.kv_dtype))

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """`init_forward_metadata` for a padded DECODE batch about to be captured.

        The metadata must live in the buffers of `init_cuda_graph_state` (sliced to
        `batch.batch_size` rows), and the layers must not compute anything from host values
        during the forward: a graph replays the captured kernels with their captured arguments.
        """
        raise NotImplementedError(self.cuda_graph_unsupported_reason(batch.kv_pool.dtype))

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Before a replay, outside the graph: write this step's metadata into the buffers the
        graph captured. `batch` is the captured padded batch holding this step's values."""
        raise NotImplementedError(self.cuda_graph_unsupported_reason(batch.kv_pool.dtype))

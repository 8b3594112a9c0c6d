"""`flashinfer` attention: FlashInfer's paged prefill and decode wrappers on NVIDIA GPUs.

FlashInfer sees the KV pool as pages of one slot each (`k_buffer[layer]` viewed as
`[num_slots, 1, Hkv, D]`, NHD layout), and each request's page list is its row of
`req_to_token`. That is right for any page size of ArborLM's allocator, since a one-slot page
is addressed exactly like a token. Prefill runs with FlashInfer's causal mask, which aligns the
new tokens with the end of the KV sequence — position `prefix + i` for new token i.

`init_forward_metadata` builds the index arrays once per step; the wrapper is *planned* at the
first layer of the step (only then are head counts, head size and scale known) and reused by
every later layer with the same shape. `flashinfer` is imported on first use only, so
`import arborlm` and the CPU install never need it.

FlashInfer has no float32 kernels: a float32 KV pool is served by the Triton backend instead
(CUDA graphs included).

CUDA graphs: each captured batch size gets its own decode wrapper in FlashInfer's CUDA-graph
mode (`use_cuda_graph=True`), whose index arrays live in buffers allocated once and shared by
all sizes. The wrapper is planned for the layers' shape before capture and again before every
replay, outside the graph: planning copies this step's page table into those buffers. The graph
itself only runs the kernels. The runner, not this module, captures and replays.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from arborlm.errors import ArborLMError
from arborlm.runtime.attention.base import (
    AttentionBackend,
    AttentionLayerSpec,
    CudaGraphShape,
)
from arborlm.runtime.forward_batch import ForwardBatch

WORKSPACE_BYTES = 128 * 1024 * 1024
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _import_flashinfer() -> ModuleType:
    try:
        import flashinfer
    except ImportError as e:
        raise ArborLMError(
            "attention_backend='flashinfer' needs the flashinfer package "
            "(pip install flashinfer-python); use 'triton' or 'torch_native' instead") from e
    return flashinfer


@dataclass
class _FlashInferMeta:
    kv_indptr: torch.Tensor  # [B+1] int32 host: offsets of each request in kv_indices
    kv_indices: torch.Tensor  # [sum seq_lens] int32 device: KV slots, request after request
    last_page_len: torch.Tensor  # [B] int32 host: all ones (one-slot pages)
    qo_indptr: torch.Tensor | None  # [B+1] int32 host: offsets of new tokens (EXTEND only)
    plan_key: tuple | None = None  # layer shape the wrapper was last planned for
    graph_wrapper: Any = None  # CUDA-graph decode wrapper, planned before the step


@dataclass
class _GraphState:
    """Index buffers shared by the CUDA-graph decode wrappers, and one wrapper per size."""

    layer: AttentionLayerSpec
    kv_indptr: torch.Tensor  # [max_bs + 1] int32 device
    kv_indices: torch.Tensor  # [max_bs * max_context_len] int32 device
    last_page_len: torch.Tensor  # [max_bs] int32 device, all ones
    wrappers: dict[int, Any]  # batch size -> BatchDecodeWithPagedKVCacheWrapper


def _plan_key(layer: AttentionLayerSpec) -> tuple:
    return (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling)


def _use_tensor_cores(layer: AttentionLayerSpec) -> bool:
    return layer.num_heads // layer.num_kv_heads > 4  # as SGLang decides


class FlashInferBackend(AttentionBackend):
    """Attention through FlashInfer; falls back to Triton for float32 KV pools."""

    def __init__(self, device: str):
        self.device = device
        self._flashinfer: ModuleType | None = None
        self._workspace: torch.Tensor | None = None
        self._prefill: Any = None
        self._decode: dict[bool, Any] = {}  # use_tensor_cores -> decode wrapper
        self._fallback: AttentionBackend | None = None
        self._graph: _GraphState | None = None

    def _uses_fallback(self, batch: ForwardBatch) -> bool:
        return batch.kv_pool.dtype not in _HALF_DTYPES

    def _fallback_backend(self) -> AttentionBackend:
        if self._fallback is None:
            from arborlm.runtime.attention.triton_backend import TritonBackend

            self._fallback = TritonBackend()
        return self._fallback

    def _ensure_flashinfer(self) -> ModuleType:
        if self._flashinfer is None:
            self._flashinfer = _import_flashinfer()
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._flashinfer

    @staticmethod
    def _page_table(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_indptr `[B+1]` int32 (host) and kv_indices `[sum seq_lens]` int32 (device)."""
        seq_lens = batch.seq_lens_cpu
        kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
        table = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :max(seq_lens)]
        positions = torch.arange(table.shape[1], device=table.device)
        kv_indices = table[positions[None, :] < batch.seq_lens[:, None]].to(torch.int32)
        return kv_indptr, kv_indices

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if self._uses_fallback(batch):
            self._fallback_backend().init_forward_metadata(batch)
            return
        self._ensure_flashinfer()
        seq_lens = batch.seq_lens_cpu
        kv_indptr, kv_indices = self._page_table(batch)
        qo_indptr = None
        if not batch.mode.is_decode:
            qo_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(
                torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int32), 0)
        batch.attn_metadata = _FlashInferMeta(
            kv_indptr=kv_indptr, kv_indices=kv_indices,
            last_page_len=torch.ones(len(seq_lens), dtype=torch.int32), qo_indptr=qo_indptr)

    def cuda_graph_unsupported_reason(self, kv_dtype: torch.dtype) -> str | None:
        if kv_dtype not in _HALF_DTYPES:
            return self._fallback_backend().cuda_graph_unsupported_reason(kv_dtype)
        try:
            self._ensure_flashinfer()
        except ArborLMError as e:
            return str(e)
        return None

    def init_cuda_graph_state(self, shape: CudaGraphShape) -> None:
        if shape.kv_dtype not in _HALF_DTYPES:
            self._fallback_backend().init_cuda_graph_state(shape)
            return
        self._ensure_flashinfer()
        i32, dev = torch.int32, shape.device
        self._graph = _GraphState(
            layer=shape.layer,
            kv_indptr=torch.zeros(shape.max_bs + 1, dtype=i32, device=dev),
            kv_indices=torch.zeros(shape.max_bs * shape.max_context_len, dtype=i32, device=dev),
            last_page_len=torch.ones(shape.max_bs, dtype=i32, device=dev),
            wrappers={})

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        if self._uses_fallback(batch):
            self._fallback_backend().init_forward_metadata_capture(batch)
            return
        g, bs = self._graph, batch.batch_size
        assert g is not None and batch.mode.is_decode, "graph state not initialised"
        g.wrappers[bs] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=_use_tensor_cores(g.layer),
            paged_kv_indptr_buffer=g.kv_indptr[:bs + 1], paged_kv_indices_buffer=g.kv_indices,
            paged_kv_last_page_len_buffer=g.last_page_len[:bs])
        self.init_forward_metadata_replay(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        if self._uses_fallback(batch):
            self._fallback_backend().init_forward_metadata_replay(batch)
            return
        g, bs = self._graph, batch.batch_size
        assert g is not None and bs in g.wrappers, f"no CUDA-graph wrapper for batch size {bs}"
        wrapper, layer, kv_dtype = g.wrappers[bs], g.layer, batch.kv_pool.dtype
        kv_indptr, kv_indices = self._page_table(batch)
        last_page_len = torch.ones(bs, dtype=torch.int32)
        wrapper.plan(kv_indptr, kv_indices, last_page_len, layer.num_heads, layer.num_kv_heads,
                     layer.head_dim, 1, sm_scale=layer.scaling, q_data_type=kv_dtype,
                     kv_data_type=kv_dtype)
        batch.attn_metadata = _FlashInferMeta(
            kv_indptr=kv_indptr, kv_indices=kv_indices, last_page_len=last_page_len,
            qo_indptr=None, plan_key=_plan_key(layer), graph_wrapper=wrapper)

    def _paged_kv(self, batch: ForwardBatch, layer: AttentionLayerSpec) -> tuple:
        k = batch.kv_pool.k_buffer[layer.layer_id].unsqueeze(1)  # [num_slots, 1, Hkv, D]
        v = batch.kv_pool.v_buffer[layer.layer_id].unsqueeze(1)
        return k, v

    def _wrapper(self, batch: ForwardBatch, layer: AttentionLayerSpec) -> Any:
        """The wrapper for this step, planned for `layer`'s shape if not already."""
        meta: _FlashInferMeta = batch.attn_metadata
        fi = self._flashinfer
        kv_dtype = batch.kv_pool.dtype
        key = _plan_key(layer)
        if meta.graph_wrapper is not None:
            assert meta.plan_key == key, "layers differ from the shape the graph was planned for"
            return meta.graph_wrapper
        common = dict(sm_scale=layer.scaling, q_data_type=kv_dtype, kv_data_type=kv_dtype)
        if batch.mode.is_decode:
            tensor_cores = _use_tensor_cores(layer)
            if tensor_cores not in self._decode:
                self._decode[tensor_cores] = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=tensor_cores)
            wrapper = self._decode[tensor_cores]
            if meta.plan_key != key:
                wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.last_page_len,
                             layer.num_heads, layer.num_kv_heads, layer.head_dim, 1, **common)
        else:
            if self._prefill is None:
                self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            wrapper = self._prefill
            if meta.plan_key != key:
                wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                             meta.last_page_len, layer.num_heads, layer.num_kv_heads,
                             layer.head_dim, 1, causal=True, **common)
        meta.plan_key = key
        return wrapper

    def _run(self, q: torch.Tensor, layer: AttentionLayerSpec,
             batch: ForwardBatch) -> torch.Tensor:
        wrapper = self._wrapper(batch, layer)
        q_in = q.to(batch.kv_pool.dtype).contiguous()  # [N, H, D]
        out = wrapper.run(q_in, self._paged_kv(batch, layer))  # [N, H, D]
        return out.to(q.dtype)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        if self._uses_fallback(batch):
            return self._fallback.forward_extend(q, layer, batch)
        return self._run(q, layer, batch)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        if self._uses_fallback(batch):
            return self._fallback.forward_decode(q, layer, batch)
        return self._run(q, layer, batch)

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

FlashInfer has no float32 kernels: a float32 KV pool is served by the Triton backend instead.
This module does not capture CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from arborlm.errors import ArborLMError
from arborlm.runtime.attention.base import AttentionBackend, AttentionLayerSpec
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


class FlashInferBackend(AttentionBackend):
    """Attention through FlashInfer; falls back to Triton for float32 KV pools."""

    def __init__(self, device: str):
        self.device = device
        self._flashinfer: ModuleType | None = None
        self._workspace: torch.Tensor | None = None
        self._prefill: Any = None
        self._decode: dict[bool, Any] = {}  # use_tensor_cores -> decode wrapper
        self._fallback: AttentionBackend | None = None

    def _uses_fallback(self, batch: ForwardBatch) -> bool:
        return batch.kv_pool.dtype not in _HALF_DTYPES

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if self._uses_fallback(batch):
            if self._fallback is None:
                from arborlm.runtime.attention.triton_backend import TritonBackend

                self._fallback = TritonBackend()
            self._fallback.init_forward_metadata(batch)
            return
        if self._flashinfer is None:
            self._flashinfer = _import_flashinfer()
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        seq_lens = batch.seq_lens_cpu
        kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
        table = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :max(seq_lens)]
        positions = torch.arange(table.shape[1], device=table.device)
        kv_indices = table[positions[None, :] < batch.seq_lens[:, None]].to(torch.int32)
        qo_indptr = None
        if not batch.mode.is_decode:
            qo_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(
                torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int32), 0)
        batch.attn_metadata = _FlashInferMeta(
            kv_indptr=kv_indptr, kv_indices=kv_indices,
            last_page_len=torch.ones(len(seq_lens), dtype=torch.int32), qo_indptr=qo_indptr)

    def _paged_kv(self, batch: ForwardBatch, layer: AttentionLayerSpec) -> tuple:
        k = batch.kv_pool.k_buffer[layer.layer_id].unsqueeze(1)  # [num_slots, 1, Hkv, D]
        v = batch.kv_pool.v_buffer[layer.layer_id].unsqueeze(1)
        return k, v

    def _wrapper(self, batch: ForwardBatch, layer: AttentionLayerSpec) -> Any:
        """The wrapper for this step, planned for `layer`'s shape if not already."""
        meta: _FlashInferMeta = batch.attn_metadata
        fi = self._flashinfer
        kv_dtype = batch.kv_pool.dtype
        key = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling)
        common = dict(sm_scale=layer.scaling, q_data_type=kv_dtype, kv_data_type=kv_dtype)
        if batch.mode.is_decode:
            tensor_cores = layer.num_heads // layer.num_kv_heads > 4  # as SGLang decides
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

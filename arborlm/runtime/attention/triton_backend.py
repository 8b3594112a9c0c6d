"""`triton` attention: paged decode and extend kernels written in Triton.

`init_forward_metadata` turns the batch's host-side lengths into the few small device tensors
the kernels read (one host-to-device copy per step, shared by every layer); `forward_extend` and
`forward_decode` launch the kernels of `triton_kernels` over the shared KV pool. Works for any
page size, since the kernels gather K/V per position through `req_to_token`.

Runs on a GPU (written for NVIDIA), and on CPU only in Triton's interpreter
(`TRITON_INTERPRET=1` set before Triton is first imported), which is how CI tests it. It is not
a fallback for CPU serving: the interpreter is orders of magnitude slower than `torch_native`.

CUDA graphs: a captured decode step launches the fixed split grid `MAX_KV_SPLITS` (a request's
own split count still comes from its own length, so its output does not change), reads the
per-request split counts from a buffer refilled before each replay, and keeps its per-split
partial results in scratch buffers allocated once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.errors import ArborLMError
from arborlm.runtime.attention.base import (
    AttentionBackend,
    AttentionLayerSpec,
    CudaGraphShape,
)
from arborlm.runtime.attention.triton_kernels import (
    INTERPRET,
    MAX_KV_SPLITS,
    decode_attention_fwd,
    extend_attention_fwd,
    num_kv_splits,
    request_kv_splits,
)
from arborlm.runtime.forward_batch import ForwardBatch


@dataclass
class _DecodeMeta:
    kv_splits: torch.Tensor  # [B] int32 splits of each request's context
    grid_splits: int  # splits in the launch grid (from the longest sequence)
    # CUDA graphs only: (mid_o [B, H, S, D], mid_lse [B, H, S]) float32 partial results.
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class _GraphBuffers:
    """Decode metadata of captured steps, `max_bs` rows each, sliced per batch size."""

    kv_splits: torch.Tensor  # [max_bs] int32
    mid_o: torch.Tensor  # [max_bs, H, MAX_KV_SPLITS, D] float32
    mid_lse: torch.Tensor  # [max_bs, H, MAX_KV_SPLITS] float32


@dataclass
class _ExtendMeta:
    prefix_lens: torch.Tensor  # [B] int32 cached positions before the new tokens
    extend_lens: torch.Tensor  # [B] int32 new tokens
    q_start: torch.Tensor  # [B] int32 first row of each request's new tokens in q
    max_extend_len: int


class TritonBackend(AttentionBackend):
    """Attention through the Triton kernels; stateless between eager steps."""

    def __init__(self) -> None:
        self._graph: _GraphBuffers | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        _check_device(batch)
        if batch.mode.is_decode:
            splits, grid_splits = num_kv_splits(batch.seq_lens, max(batch.seq_lens_cpu))
            batch.attn_metadata = _DecodeMeta(kv_splits=splits, grid_splits=grid_splits)
            return
        prefix = batch.extend_prefix_lens_cpu
        extend = batch.extend_seq_lens_cpu
        starts = [0] * len(extend)
        for i in range(1, len(extend)):
            starts[i] = starts[i - 1] + extend[i - 1]
        lens = torch.tensor([prefix, extend, starts], dtype=torch.int32).to(
            batch.seq_lens.device, non_blocking=True)  # [3, B]
        batch.attn_metadata = _ExtendMeta(prefix_lens=lens[0], extend_lens=lens[1],
                                          q_start=lens[2], max_extend_len=max(extend, default=0))

    def cuda_graph_unsupported_reason(self, kv_dtype: torch.dtype) -> str | None:
        return None

    def init_cuda_graph_state(self, shape: CudaGraphShape) -> None:
        layer, f32 = shape.layer, torch.float32
        self._graph = _GraphBuffers(
            kv_splits=torch.ones(shape.max_bs, dtype=torch.int32, device=shape.device),
            mid_o=torch.empty((shape.max_bs, layer.num_heads, MAX_KV_SPLITS, layer.head_dim),
                              dtype=f32, device=shape.device),
            mid_lse=torch.empty((shape.max_bs, layer.num_heads, MAX_KV_SPLITS), dtype=f32,
                                device=shape.device))

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata_replay(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        assert batch.mode.is_decode and self._graph is not None, "graph state not initialised"
        _check_device(batch)
        bs, g = batch.batch_size, self._graph
        g.kv_splits[:bs].copy_(request_kv_splits(batch.seq_lens))
        batch.attn_metadata = _DecodeMeta(kv_splits=g.kv_splits[:bs], grid_splits=MAX_KV_SPLITS,
                                          scratch=(g.mid_o[:bs], g.mid_lse[:bs]))

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        meta: _ExtendMeta = batch.attn_metadata
        return extend_attention_fwd(
            q, batch.kv_pool.k_buffer[layer.layer_id], batch.kv_pool.v_buffer[layer.layer_id],
            batch.req_to_token_pool.req_to_token, batch.req_pool_indices,
            meta.prefix_lens, meta.extend_lens, meta.q_start, meta.max_extend_len,
            layer.scaling)  # [T, H, D]

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        meta: _DecodeMeta = batch.attn_metadata
        return decode_attention_fwd(
            q, batch.kv_pool.k_buffer[layer.layer_id], batch.kv_pool.v_buffer[layer.layer_id],
            batch.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens,
            meta.kv_splits, meta.grid_splits, layer.scaling, meta.scratch)  # [B, H, D]


def _check_device(batch: ForwardBatch) -> None:
    if batch.seq_lens.device.type == "cpu" and not INTERPRET:
        raise ArborLMError(
            "the triton attention backend needs a GPU; on CPU it runs only in Triton's "
            "interpreter (set TRITON_INTERPRET=1 before triton is imported)")

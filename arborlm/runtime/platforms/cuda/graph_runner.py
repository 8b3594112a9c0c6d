"""`CudaGraphRunner`: decode steps replayed from captured CUDA graphs.

A decode step of a small model is a few hundred short kernels, and on a GPU launching them costs
more than running them. At start-up the runner captures the model's decode forward once per
batch-size bucket (`capture_batch_sizes`: 1, 2, 4, 8, then multiples of 8 up to
`cuda_graph_max_bs`); a step then costs a handful of copies and one graph launch.

A graph replays the kernels it captured with the arguments it captured, so every input lives in
a static buffer (`DecodeInputBuffers`) and the attention backend keeps its decode metadata in
buffers of its own (`init_cuda_graph_state` / `init_forward_metadata_capture` / `_replay`). A
batch of B requests runs in the graph of the smallest bucket >= B: rows B.. are padding, which
decode token 0 at position 0 with a sequence length of 1 through `req_to_token` row 0, write
their K/V to slot 0 (the reserved padding slot, never handed to a request), and whose logits are
dropped. Rows never interact in the forward, so the padding cannot change a real row.

The forward must be graph-safe: no host syncs and no shapes taken from host values. The model
forward is (it reads only the batch's device tensors), as are the triton and flashinfer decode
paths; torch_native decode sizes its gather by the longest sequence, so it runs eagerly.

Not here: extend steps and decode batches above the largest bucket run eagerly (`ModelRunner`
asks `can_run`), and nothing in this module changes the arithmetic of a step.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from arborlm.runtime.attention.base import AttentionBackend, AttentionLayerSpec, CudaGraphShape
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.decode_executor import DecodeExecutor, DecodeParts
from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
from arborlm.runtime.memory_pool import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

PADDING_SEQ_LEN = 1
# Padding row values, in the order of `DecodeInputBuffers.FIELDS`: token 0 at position 0 of
# req_to_token row 0, sequence length 1, K/V written to the padding slot 0.
PADDING_ROW = (0, 0, 0, PADDING_SEQ_LEN, 0)
WARMUP_RUNS = 2  # eager runs before each capture: compile kernels, create cuBLAS workspaces


def capture_batch_sizes(max_bs: int) -> list[int]:
    """Buckets to capture, ascending: 1, 2, 4, then multiples of 8 below `max_bs`, then it."""
    assert max_bs >= 1, "cuda_graph_max_bs must be >= 1"
    return [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8)) + [max_bs]


def padded_batch_size(bs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= `bs` (`sizes` ascending), or None when `bs` is larger."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


def attention_layer_shape(model: nn.Module) -> AttentionLayerSpec | None:
    """The attention shape every layer of `model` shares, or None if layers differ."""
    specs = [m.spec for m in model.modules() if isinstance(getattr(m, "spec", None),
                                                           AttentionLayerSpec)]
    shapes = {(s.num_heads, s.num_kv_heads, s.head_dim, s.scaling) for s in specs}
    return specs[0] if len(shapes) == 1 else None


def graphs_off_reason(args: EngineArgs, device: str, backend: AttentionBackend,
                      kv_dtype: torch.dtype) -> str | None:
    """Why decode steps cannot use CUDA graphs with these settings, or None when they can."""
    if args.disable_cuda_graph:
        return "disable_cuda_graph is set"
    if not device.startswith("cuda"):
        return f"device is {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return backend.cuda_graph_unsupported_reason(kv_dtype)


class DecodeInputBuffers:
    """Static decode inputs for up to `max_bs` rows, loaded from a batch and padded.

    One `[5, max_bs]` int64 tensor holds the five per-row inputs, so that loading a step is a
    single stack-and-copy plus a single padding copy, whatever the batch size.
    """

    FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")

    def __init__(self, max_bs: int, device: torch.device | str):
        self.max_bs = max_bs
        pad = torch.tensor(PADDING_ROW, dtype=torch.int64, device=device)  # [5]
        self._padding = pad[:, None].expand(len(self.FIELDS), max_bs)  # [5, max_bs] view
        self.data = self._padding.clone()  # [5, max_bs] int64, every row padding

    def field(self, name: str, bs: int) -> torch.Tensor:
        """The first `bs` rows of one input, a view of the static buffer `[bs]`."""
        return self.data[self.FIELDS.index(name), :bs]

    def pad(self, start: int, end: int) -> None:
        """Make rows `[start, end)` padding rows."""
        if end > start:
            self.data[:, start:end].copy_(self._padding[:, start:end])

    def load(self, batch: ForwardBatch, padded_bs: int) -> None:
        """Copy `batch`'s inputs into rows `[0, B)` and padding into rows `[B, padded_bs)`."""
        bs = batch.batch_size
        assert bs <= padded_bs <= self.max_bs and batch.num_tokens == bs, "not a decode batch"
        self.data[:, :bs].copy_(torch.stack([getattr(batch, f) for f in self.FIELDS]))  # [5, B]
        self.pad(bs, padded_bs)


class PaddedDecodeStep:
    """The decode forward over `DecodeInputBuffers`: what a graph captures and replays.

    `capture_batch(bs)` is the all-padding batch a graph of size `bs` is captured with;
    `prepare(batch, bs)` loads a real step into the same buffers and refreshes the backend's
    metadata, after which running (or replaying) the step of size `bs` computes it.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend,
                 req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, max_bs: int,
                 device: torch.device | str):
        self.model = model
        self.backend = backend
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.buffers = DecodeInputBuffers(max_bs, device)
        self._batches: dict[int, ForwardBatch] = {}

    def _static_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        fb = self._batches.get(bs)
        if fb is None:
            f = self.buffers.field
            fb = ForwardBatch(
                mode=ForwardMode.DECODE, batch_size=bs, input_ids=f("input_ids", bs),
                positions=f("positions", bs), req_pool_indices=f("req_pool_indices", bs),
                seq_lens=f("seq_lens", bs), out_cache_loc=f("out_cache_loc", bs),
                req_to_token_pool=self.req_to_token_pool, kv_pool=self.kv_pool,
                seq_lens_cpu=seq_lens_cpu, logits_indices=None, attn_backend=self.backend)
            self._batches[bs] = fb
        fb.seq_lens_cpu = seq_lens_cpu
        return fb

    def capture_batch(self, bs: int) -> ForwardBatch:
        """The batch of `bs` padding rows a graph is captured with, its metadata initialised."""
        self.buffers.pad(0, bs)
        fb = self._static_batch(bs, [PADDING_SEQ_LEN] * bs)
        self.backend.init_forward_metadata_capture(fb)
        return fb

    def prepare(self, batch: ForwardBatch, bs: int) -> ForwardBatch:
        """Load `batch` padded to `bs` rows and write the backend's metadata for it."""
        pad = bs - batch.batch_size
        fb = self._static_batch(bs, list(batch.seq_lens_cpu) + [PADDING_SEQ_LEN] * pad)
        self.buffers.load(batch, bs)
        self.backend.init_forward_metadata_replay(fb)
        return fb

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits `[bs, vocab]` float32 of every row of the static batch `fb`."""
        return self.model.compute_logits(self.model(fb))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bs, vocab] float32, written by every replay


class CudaGraphRunner(DecodeExecutor):
    """Captures the decode step for every bucket at construction; replays it per step."""

    def __init__(self, model: nn.Module, backend: AttentionBackend,
                 req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, max_bs: int,
                 layer: AttentionLayerSpec):
        device = req_to_token_pool.req_to_token.device
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.step = PaddedDecodeStep(model, backend, req_to_token_pool, kv_pool, max_bs, device)
        backend.init_cuda_graph_state(CudaGraphShape(
            max_bs=max_bs, max_context_len=req_to_token_pool.max_context_len, layer=layer,
            kv_dtype=kv_pool.dtype, device=device))
        self._graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):  # largest first: smaller ones reuse its pool
                self._graphs[bs] = self._capture(bs)

    def _capture(self, bs: int) -> _Graph:
        fb = self.step.capture_batch(bs)
        torch.cuda.synchronize()
        with torch.cuda.stream(self._stream):
            for _ in range(WARMUP_RUNS):
                self.step.run(fb)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            logits = self.step.run(fb)  # [bs, vocab]
        torch.cuda.synchronize()
        return _Graph(graph=graph, logits=logits)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A decode step of at most the largest bucket, whose logits are wanted for every row."""
        if not batch.mode.is_decode or batch.batch_size > self.batch_sizes[-1]:
            return False
        rows = batch.logits_indices
        return rows is None or rows.numel() == batch.batch_size

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[B, vocab]` float32 of `batch` (valid until the next replay)."""
        bs = padded_batch_size(batch.batch_size, self.batch_sizes)
        assert bs is not None, "batch larger than the largest captured size"
        self.step.prepare(batch, bs)
        captured = self._graphs[bs]
        captured.graph.replay()
        return captured.logits[:batch.batch_size]


def create_cuda_graph_runner(parts: DecodeParts) -> CudaGraphRunner | None:
    """A `CudaGraphRunner` for `parts.model`, or None (logged) when decode stays eager.

    Never raises for a capture that fails: it logs the error and the engine decodes eagerly.
    """
    args = parts.args
    backend = parts.attn_backend
    reason = graphs_off_reason(args, parts.device, backend, parts.kv_pool.dtype)
    layer = attention_layer_shape(parts.model)
    if reason is None and layer is None:
        reason = "the model's attention layers differ in shape"
    if reason is not None:
        logger.info("CUDA graphs off: %s; decode runs eagerly", reason)
        return None
    max_bs = min(args.cuda_graph_max_bs, args.max_running_requests)
    start = time.perf_counter()
    try:
        graph_runner = CudaGraphRunner(parts.model, backend, parts.req_to_token_pool,
                                       parts.kv_pool, max_bs, layer)
    except Exception as e:  # any capture failure: serve eagerly instead of failing to start
        logger.warning("CUDA graph capture failed (%s: %s); decode runs eagerly",
                       type(e).__name__, e)
        torch.cuda.empty_cache()
        return None
    logger.info("CUDA graphs on: captured decode batch sizes %s in %.1f s",
                graph_runner.batch_sizes, time.perf_counter() - start)
    return graph_runner

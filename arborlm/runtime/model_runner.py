"""`ModelRunner`: owns the model, the KV memory and the attention backend; runs one forward.

It sizes the KV pool (from `max_total_tokens`, or a fraction of free memory), loads the weights,
and turns a `ForwardBatch` into float32 logits for the rows the scheduler asked for; decode
steps replay captured CUDA graphs where `cuda_graph_runner` can, and on CPU run compiled
(`compiled_decode`) with `enable_torch_compile`. With deterministic inference every linear runs
on the panel kernel and attention on one kernel for extend and decode (see
`docs/determinism.md`). It does not decide what runs:
that is the scheduler's job.
"""

from __future__ import annotations

import ctypes
import logging

import psutil
import torch

from arborlm.errors import InvalidRequestError, ModelLoadError
from arborlm.runtime import startup
from arborlm.runtime.attention.base import create_attention_backend
from arborlm.runtime.compiled_decode import (
    CompiledDecodeRunner,
    FusedDecodeStep,
    create_compiled_decode_runner,
    create_fused_decode_step,
    decode_fits,
)
from arborlm.runtime.config import EngineConfig
from arborlm.runtime.cuda_graph_runner import CudaGraphRunner, create_cuda_graph_runner
from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.layers import cpu_kernels
from arborlm.runtime.layers.cpu_linear import pack_linears
from arborlm.runtime.layers.huge_pages import HugePageArena, move_decode_weights
from arborlm.runtime.memory_pool import KVPool, PagedAllocator, ReqToTokenPool

logger = logging.getLogger(__name__)

# Cap on the default pool size, so that a default CPU engine does not reserve tens of GB.
DEFAULT_MAX_POOL_TOKENS = 262_144
# glibc malloc serves blocks above its mmap threshold (128 KiB at first) with fresh mappings, so
# each step's activations and KV gathers would page-fault their memory in anew, and free() trims
# the heap back. Raising both limits keeps that memory in the process: on CPU a step's large
# temporaries then cost what their arithmetic costs (a 10 MB gather: 4.4 ms -> 1.0 ms).
_MALLOC_MMAP_THRESHOLD = 256 << 20
_MALLOC_TRIM_THRESHOLD = 1 << 30


def keep_cpu_allocations() -> bool:
    """Make glibc keep freed large blocks for reuse (see above); False where it is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        return bool(libc.mallopt(m_mmap_threshold, _MALLOC_MMAP_THRESHOLD)
                    and libc.mallopt(m_trim_threshold, _MALLOC_TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


class ModelRunner:
    def __init__(self, config: EngineConfig):
        from arborlm.runtime.models.registry import load_model

        self.config = config
        args, mc = config.args, config.model
        self.device = args.device
        if self.device == "cpu":
            keep_cpu_allocations()
        torch.manual_seed(args.random_seed)
        self.model = load_model(mc, device=self.device)
        self.deterministic = self._deterministic_holds()
        self.weight_arena: HugePageArena | None = None  # keeps the weights' mapping alive
        if self.device == "cpu":
            packed = pack_linears(self.model, transpose_fp32=not args.enable_torch_compile,
                                  panels_only=self.deterministic)
            logger.info("%d linear weights prepacked (%s)", packed,
                        "panels, every batch size" if self.deterministic else "oneDNN")
            self.weight_arena = move_decode_weights(self.model)
        self.vocab_size = mc.vocab_size
        self.page_size = args.page_size
        startup.phase("allocating the KV pool")
        num_slots = self._pool_slots()
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests + 2,
                                                mc.context_length + self.page_size,
                                                device=self.device)
        self.kv_pool = KVPool(num_slots, mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype,
                              device=self.device)
        self.allocator = PagedAllocator(num_slots, self.page_size)
        self.attn_backend = create_attention_backend(config.attention_backend, self.device,
                                                     deterministic=self.deterministic)
        logger.info("KV pool: %d tokens (%d pages of %d), %s, backend %s",
                    self.allocator.total_size, self.allocator.num_pages - 1, self.page_size,
                    mc.dtype, config.attention_backend)
        startup.phase("warming up")
        self.graph_runner: CudaGraphRunner | None = create_cuda_graph_runner(self)
        self.compiled: CompiledDecodeRunner | None = create_compiled_decode_runner(self)
        self.fused: FusedDecodeStep | None = create_fused_decode_step(self)

    def _deterministic_holds(self) -> bool:
        """Whether this engine runs deterministic inference: wanted (`EngineConfig`), and the
        kernels it needs built and fitting the model's attention heads. Asked for explicitly
        where they are not, it is an error; by default it is then off, and logged."""
        if not self.config.deterministic:
            logger.info("deterministic inference: off")
            return False
        mc = self.config.model
        missing = None
        if not (cpu_kernels.available(mc.dtype) and cpu_kernels.elementwise_available(mc.dtype)):
            missing = f"ArborLM's CPU kernels for {mc.dtype} are not available here"
        elif not cpu_kernels.attention_fits(mc.dtype, mc.num_heads // mc.num_kv_heads,
                                            mc.head_dim):
            missing = (f"its attention kernel does not take {mc.num_heads // mc.num_kv_heads} "
                       f"query heads per KV head of dimension {mc.head_dim}")
        if missing is None:
            logger.info("deterministic inference: on (batch-invariant kernels)")
            return True
        if self.config.args.enable_deterministic_inference:
            raise ModelLoadError(f"enable_deterministic_inference cannot hold: {missing}")
        logger.warning("deterministic inference: off, as %s", missing)
        return False

    def _pool_slots(self) -> int:
        args, mc = self.config.args, self.config.model
        per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype)
        if args.max_total_tokens is not None:
            if args.max_total_tokens < 2 * self.page_size:
                raise InvalidRequestError(
                    f"max_total_tokens must be at least {2 * self.page_size}", "max_total_tokens")
            tokens = args.max_total_tokens
        else:
            if self.device.startswith("cuda"):
                free = torch.cuda.mem_get_info()[0]
            else:
                free = psutil.virtual_memory().available
            tokens = int(free * args.mem_fraction) // per_token
            tokens = min(tokens, DEFAULT_MAX_POOL_TOKENS,
                         args.max_running_requests * mc.context_length)
        pages = -(-tokens // self.page_size) + 1  # +1: page 0 is the reserved padding page
        return pages * self.page_size

    def can_run_ahead(self, batch: ForwardBatch) -> bool:
        """Whether `run_ahead` takes this decode batch: a fused decode step serves it."""
        if self.fused is not None:
            return decode_fits(batch, self.config.args.max_running_requests, shared_prefix=True)
        compiled = self.compiled
        return compiled is not None and compiled.fused is not None and compiled.can_run(batch)

    @torch.inference_mode()
    def run_ahead(self, batch: ForwardBatch, slots: torch.Tensor) -> torch.Tensor:
        """Greedy tokens `[S, B]` of S decode steps in one call, the first being `batch`'s
        (`FusedDecodeStep.run_ahead`; `slots` `[S, B]`). Needs `can_run_ahead`."""
        fused = self.fused if self.fused is not None else self.compiled.fused
        return fused.run_ahead(batch, slots)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[N, vocab]` float32 for `batch.logits_indices` (all rows if None)."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        if self.compiled is not None and self.compiled.can_run(batch):
            return self.compiled.forward(batch)
        if self.fused is not None and decode_fits(batch, self.config.args.max_running_requests,
                                                  shared_prefix=True):
            return self.fused.run(batch)
        batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(batch)
        hidden = self.model(batch)
        return self.model.compute_logits(hidden)

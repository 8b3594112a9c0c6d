"""`CompiledDecodeRunner`: decode steps run through `torch.compile` (a decode executor).

On CPU a small model's eager decode step is a few hundred short ATen calls, each paying
dispatch and thread start-up costs that can exceed its arithmetic. With `enable_torch_compile`,
the model's own forward (the same modules, weights and numerics) is compiled by Inductor into a
handful of fused C++ kernels around the matmuls; attention runs through
`CompiledDecodeAttention`, which the compiler can trace, and the packed linears call ArborLM's
own kernel (`kernels.panel_linear`) or, where it cannot run, become streaming reduction
kernels for one row (`linear.row_linear`; small unpacked layers are made `RowLinear`s) and
opaque calls of the packed oneDNN weights for more (`linear.packed_linear`).

This executor serves the models the fused C++ step does not take (`fused_decode`: q/k norms,
as in Qwen3, or no CPU kernels); where that step applies it is chosen instead and nothing is
compiled. The graphs are compiled when the engine starts, with the KV length dynamic: one for
batch size 1 and, when `torch_compile_max_bs` > 1 (32 by default, as in SGLang), one with the
batch size dynamic (2 to it), so no step ever waits for a compile and no batch is padded.
Inductor caches compiled code on disk, so later engines start faster. Larger decode batches,
batches whose requests share a cached prefix (the graph would read the prefix once per
request; eager cascade attention reads it once), extend steps and, without the CPU attention
kernel, sequences longer than `COMPILED_MAX_SEQ_LEN` run eagerly.

After the warm-up, steps skip Dynamo's guards: the code Dynamo generated for each graph (caught
with a bytecode hook, as vLLM's compile wrapper does) is called directly, the graph picked by
batch size. The guards could only fail on what `can_run` and the engine already fix (a decode
batch, its size, the KV length's range, the pool's tensors and dtypes), and checking them costs
tens of microseconds a step.

Compiled kernels sum in other orders than eager ones, so logits differ in the last bits; the
tests check that greedy outputs stay equal to the eager engine's and to `transformers`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import CodeType, FunctionType

import torch
from torch import nn
from torch._dynamo.convert_frame import register_bytecode_hook

from arborlm.runtime.decode_executor import DecodeExecutor, DecodeParts, decode_fits
from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
from arborlm.runtime.platforms.cpu import cascade
from arborlm.runtime.platforms.cpu.compiled_attention import (
    CompiledDecodeAttention,
    CompiledDecodeMeta,
    compiled_decode_metadata,
)
from arborlm.runtime.platforms.cpu.linear import use_row_linears

logger = logging.getLogger(__name__)

# Inductor options. The C++ wrapper calls the kernels without a Python frame per kernel. A
# pointwise result with more than 2 ops is stored rather than recomputed where it is read: a
# one-row linear (`row_linear`) would otherwise recompute its input's RMSNorm for every weight
# element. The generated kernels run on one thread (library matmuls of batches keep torch's
# threads): Inductor fuses a step into one OpenMP region with ~170 barriers, and on 2 shared
# cores the threads' sleeps and wake-ups cost more than the second core gives (figures in
# docs/performance.md, "Decode executors").
INDUCTOR_OPTIONS = {"cpp_wrapper": True, "realize_opcount_threshold": 2, "cpp.threads": 1,
                    "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
# Longest sequence a compiled step attends over when its attention is the traced one (no CPU
# kernel). That attention gathers every key from the pool each step, which grows faster with
# the length than the eager path's dense workspace: past about a thousand tokens the eager
# step is faster (docs/performance.md, "Decode executors"), so longer batches decode eagerly.
# ArborLM's kernel reads the pool in place and has no such limit.
COMPILED_MAX_SEQ_LEN = 1024
# Sequence length of the warm-up steps (any length >= 2 compiles the dynamic-length graph).
WARMUP_SEQ_LEN = 2


def _decode_step(model: nn.Module, batch: ForwardBatch) -> torch.Tensor:
    """Logits of a decode batch: the model's forward and head, as the eager runner computes."""
    return model.compute_logits(model(batch))  # [B, vocab] float32


class CompiledDecodeRunner(DecodeExecutor):
    """Compiles the decode step at construction (batch 1, then 2+ if `max_bs` > 1); runs
    eligible steps."""

    def __init__(self, parts: DecodeParts, max_bs: int):
        self.parts = parts
        self.model = parts.model
        self.max_bs = max_bs
        self.attention = CompiledDecodeAttention(parts.device, parts.kv_pool.dtype)
        use_row_linears(parts.model)  # packed ones trace as panel_linear / row_linear already
        # A code object of this runner's own: Dynamo's code for it (below) is this runner's.
        source = FunctionType(_decode_step.__code__.replace(), globals(), "_decode_step")
        self.step = torch.compile(source, dynamic=None, fullgraph=True, options=INDUCTOR_OPTIONS)
        self._direct: dict[int, Callable[..., torch.Tensor]] = {}
        captured: list[CodeType] = []

        def capture(old: CodeType, new: CodeType) -> None:
            if old is source.__code__:
                captured.append(new)

        sizes = sorted({1, min(2, max_bs)})
        hook = register_bytecode_hook(capture)
        try:
            for bs in sizes:
                batch = self._warmup_batch(bs)  # built outside inference mode, as the scheduler
                with torch.inference_mode():
                    self.run(batch)
        finally:
            hook.remove()
        if len(captured) == len(sizes):  # one graph per size (else every step goes via Dynamo)
            self._direct = {bs: FunctionType(code, globals(), "_decode_step")
                            for bs, code in zip(sizes, captured)}

    def can_run(self, batch: ForwardBatch) -> bool:
        """A decode step that `decode_fits` `max_bs` whose requests share no cached prefix;
        with the traced attention, none longer than `COMPILED_MAX_SEQ_LEN`."""
        if not decode_fits(batch, self.max_bs):
            return False
        if batch.batch_size > 1 and cascade.shares_a_prefix(batch):
            return False
        return self.attention.kernel or max(batch.seq_lens_cpu) <= COMPILED_MAX_SEQ_LEN

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[B, vocab]` float32 of a decode batch (`can_run` must hold)."""
        batch.attn_metadata = compiled_decode_metadata(batch)
        batch.logits_indices = None
        batch.attn_backend = self.attention
        direct = self._direct.get(min(batch.batch_size, 2))
        if direct is not None:
            return direct(self.model, batch)
        meta: CompiledDecodeMeta = batch.attn_metadata
        torch._dynamo.mark_dynamic(meta.slots, 1)  # the KV length
        if batch.batch_size > 1:
            for t in (batch.input_ids, batch.positions, batch.out_cache_loc, meta.seq_lens,
                      meta.slots):
                torch._dynamo.mark_dynamic(t, 0)
        return self.step(self.model, batch)

    def _warmup_batch(self, bs: int) -> ForwardBatch:
        """`bs` padding rows: token 0 at position 1 of `req_to_token` row 0, which maps every
        position to slot 0 (the reserved padding slot) while no request holds it: at start-up."""
        r = self.parts

        def zeros() -> torch.Tensor:  # distinct tensors: the compiler guards on aliasing
            return torch.zeros(bs, dtype=torch.int64, device=r.device)

        lens = torch.full((bs,), WARMUP_SEQ_LEN, dtype=torch.int64, device=r.device)
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=zeros(), positions=lens - 1,
            req_pool_indices=zeros(), seq_lens=lens, out_cache_loc=zeros(),
            req_to_token_pool=r.req_to_token_pool, kv_pool=r.kv_pool,
            seq_lens_cpu=[WARMUP_SEQ_LEN] * bs)


def create_compiled_decode(parts: DecodeParts) -> CompiledDecodeRunner | None:
    """A `CompiledDecodeRunner` when `enable_torch_compile` is set and the device is a CPU."""
    args = parts.args
    if not args.enable_torch_compile:
        return None
    if parts.device != "cpu":
        logger.info("torch.compile decode is for CPU; on %s decode runs as before", parts.device)
        return None
    from arborlm.runtime.platforms.cpu.quant_loading import has_quant_linears

    if has_quant_linears(parts.model):
        logger.info("torch.compile decode is off: the decoder's linears compute from packed GGUF "
                    "blocks (--quantization), which it does not compile")
        return None
    max_bs = min(args.torch_compile_max_bs, args.max_running_requests)
    start = time.perf_counter()
    compiled = CompiledDecodeRunner(parts, max_bs)
    logger.info("torch.compile decode on (batch sizes 1-%d), compiled in %.1f s", max_bs,
                time.perf_counter() - start)
    return compiled

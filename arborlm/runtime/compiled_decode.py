"""`CompiledDecodeRunner`: decode steps run through `torch.compile` (`enable_torch_compile`).

On CPU a small model's eager decode step is a few hundred short ATen calls, each paying
dispatch and thread start-up costs that can exceed its arithmetic. With `enable_torch_compile`,
the model's own forward (the same modules, weights and numerics) is compiled by Inductor into a
handful of fused C++ kernels around the matmuls; attention runs through
`CompiledDecodeAttention`, which the compiler can trace, and the packed linears call ArborLM's
own kernel (`cpu_kernels.panel_linear`) or, where it cannot run, become streaming reduction
kernels for one row (`cpu_linear.row_linear`; small unpacked layers are made `RowLinear`s) and
opaque calls of the packed oneDNN weights for more (`cpu_kernels.packed_linear`).

The graphs are compiled when the engine starts, with the KV length dynamic: one for batch size
1 and, when `torch_compile_max_bs` > 1 (32 by default, as in SGLang), one with the batch size
dynamic (2 to it), so no step ever waits for a compile and no batch is padded. Inductor
caches compiled code on disk, so later engines start faster. Larger decode batches, batches
whose requests share a cached prefix (cascade attention is eager), extend steps and, without
the CPU attention kernel, sequences longer than `COMPILED_MAX_SEQ_LEN` run eagerly
(`ModelRunner` asks `can_run`); so do decode steps on devices other than CPU, where CUDA graphs
serve instead.

Steps of Llama-family models without q/k norms (Llama, Llama 3, Mistral, Qwen2) skip the graph
where ArborLM's CPU kernels run: `FusedDecodeStep` calls `arborlm::decode_step`, the whole step
in one C++ call over the same kernels with the eager model's arithmetic. It needs no compiler,
so engines without `enable_torch_compile` decode through it too (`create_fused_decode_step`;
`ModelRunner` runs it for steps that `decode_fits`). It also takes the steps whose requests
share a cached prefix, with cascade attention of its own (`cascade_inputs`; the graph would
read the prefix once per request, so without the fused step those steps stay eager).
`benchmarks/cpu_decode_step.py` alternates the two in one engine; the graph's ms per step over
the fused step's (2-core machine, medians of 7 rounds): batch 1, 32M float32 1.080, bfloat16
1.664, 125M float32 1.103; 32 requests, 32M float32 1.120, bfloat16 1.250, 125M float32 1.031.

After the warm-up, steps skip Dynamo's guards: the code Dynamo generated for each graph (caught
with a bytecode hook, as vLLM's compile wrapper does) is called directly, the graph picked by
batch size. The guards could only fail on what `can_run` and the engine already fix (a decode
batch, its size, the KV length's range, the pool's tensors and dtypes), and checking them cost
~60-100 µs a step (tiny model, ms/token: 0.29 -> 0.22; 32M bfloat16: 2.88 -> 2.72).

Compiled kernels sum in other orders than eager ones, so logits differ in the last bits; the
tests check that greedy outputs stay equal to the eager engine's and to `transformers`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import CodeType, FunctionType
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._dynamo.convert_frame import register_bytecode_hook

from arborlm.runtime.attention import torch_native
from arborlm.runtime.attention.compiled_decode import (
    CompiledDecodeAttention,
    CompiledDecodeMeta,
    compiled_decode_metadata,
)
from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
from arborlm.runtime.layers import cpu_kernels
from arborlm.runtime.layers.cpu_linear import PackedLinear, use_row_linears

if TYPE_CHECKING:
    from arborlm.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Inductor options. The C++ wrapper calls the kernels without a Python frame per kernel. A
# pointwise result with more than 2 ops is stored rather than recomputed where it is read: a
# one-row linear (`row_linear`) would otherwise recompute its input's RMSNorm for every weight
# element. The generated kernels run on one thread (library matmuls of batches keep torch's
# threads): Inductor fuses a step into one OpenMP region with ~170 barriers, and on 2 shared
# cores the threads' sleeps and wake-ups cost more than the second core gives. Measured batch-1
# decode, load ~1: 32M float32 8.5 -> 6.6 ms/token, bfloat16 6.8 -> 4.4, 125M 21.2 -> 20.6.
INDUCTOR_OPTIONS = {"cpp_wrapper": True, "realize_opcount_threshold": 2, "cpp.threads": 1,
                    "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
# Longest sequence a compiled step attends over when its attention is the traced one (no CPU
# kernel). That attention gathers every key from the pool each step, which grows faster with
# the length than the eager path's dense workspace: 32M float32 batch 1, compiled vs eager
# ms/token: 8.5 vs 12.7 at 500 tokens, 10.4 vs 14.0 at 1000, 23.2 vs 13.8 at 2000. Longer
# batches decode eagerly. ArborLM's kernel reads the pool in place and has no such limit (32M
# bfloat16 at 2,000 tokens: compiled 3.9-4.5 against eager 5.1-5.5 ms/token).
COMPILED_MAX_SEQ_LEN = 1024
# Sequence length of the warm-up steps (any length >= 2 compiles the dynamic-length graph).
WARMUP_SEQ_LEN = 2


def _decode_step(model: nn.Module, batch: ForwardBatch) -> torch.Tensor:
    """Logits of a decode batch: the model's forward and head, as the eager runner computes."""
    return model.compute_logits(model(batch))  # [B, vocab] float32


class CompiledDecodeRunner:
    """Compiles the decode step at construction (batch 1, then 2+ if `max_bs` > 1); runs
    eligible steps."""

    def __init__(self, runner: ModelRunner, max_bs: int):
        self.runner = runner
        self.max_bs = max_bs
        self.attention = CompiledDecodeAttention(runner.device, runner.kv_pool.dtype)
        self.fused: FusedDecodeStep | None = None  # set after the warm-up (below)
        use_row_linears(runner.model)  # packed ones trace as panel_linear / row_linear already
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
                    self.forward(batch)
        finally:
            hook.remove()
        if len(captured) == len(sizes):  # one graph per size (else every step goes via Dynamo)
            self._direct = {bs: FunctionType(code, globals(), "_decode_step")
                            for bs, code in zip(sizes, captured)}
        # Steps run as one C++ call where the model allows (`FusedDecodeStep`).
        if self.attention.kernel and not runner.config.args.disable_fused_decode:
            self.fused = FusedDecodeStep.of(runner)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A decode step that `decode_fits` `max_bs`; with the traced attention, none longer
        than `COMPILED_MAX_SEQ_LEN`."""
        if not decode_fits(batch, self.max_bs, shared_prefix=self.fused is not None):
            return False
        return self.attention.kernel or max(batch.seq_lens_cpu) <= COMPILED_MAX_SEQ_LEN

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[B, vocab]` float32 of a decode batch (`can_run` must hold)."""
        if self.fused is not None:
            return self.fused.run(batch)
        batch.attn_metadata = compiled_decode_metadata(batch)
        batch.logits_indices = None
        return self._run(batch)

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        batch.attn_backend = self.attention
        direct = self._direct.get(min(batch.batch_size, 2))
        if direct is not None:
            return direct(self.runner.model, batch)
        meta: CompiledDecodeMeta = batch.attn_metadata
        torch._dynamo.mark_dynamic(meta.slots, 1)  # the KV length
        if batch.batch_size > 1:
            for t in (batch.input_ids, batch.positions, batch.out_cache_loc, meta.seq_lens,
                      meta.slots):
                torch._dynamo.mark_dynamic(t, 0)
        return self.step(self.runner.model, batch)

    def _warmup_batch(self, bs: int) -> ForwardBatch:
        """`bs` padding rows: token 0 at position 1 of `req_to_token` row 0, which maps every
        position to slot 0 (the reserved padding slot) while no request holds it: at start-up."""
        r = self.runner

        def zeros() -> torch.Tensor:  # distinct tensors: the compiler guards on aliasing
            return torch.zeros(bs, dtype=torch.int64, device=r.device)

        lens = torch.full((bs,), WARMUP_SEQ_LEN, dtype=torch.int64, device=r.device)
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=zeros(), positions=lens - 1,
            req_pool_indices=zeros(), seq_lens=lens, out_cache_loc=zeros(),
            req_to_token_pool=r.req_to_token_pool, kv_pool=r.kv_pool,
            seq_lens_cpu=[WARMUP_SEQ_LEN] * bs)


class FusedDecodeStep:
    """A decode step of a Llama-family model (no q/k norm) as one C++ call,
    `arborlm::decode_step`: the same kernels and the eager model's arithmetic, without the
    compiled graph's ~40 dispatcher calls and its elementwise kernels (see
    `csrc/decode_step.cpp`)."""

    def __init__(self, runner: ModelRunner, weights: list[torch.Tensor | None], intermediate: int):
        model = runner.model
        self.intermediate = intermediate
        spec = model.model.layers[0].self_attn.spec
        self.weights = weights
        self.k_pool, self.v_pool = runner.kv_pool.k_buffer, runner.kv_pool.v_buffer
        self.cos, self.sin = model.model.rotary.cos, model.model.rotary.sin
        self.eps = model.model.norm.eps
        self.shape = (spec.scaling, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        # Deterministic inference has no cascade: a request's attention reads its own keys in
        # one pass, whoever shares them.
        self.cascade = not runner.deterministic

    @classmethod
    def of(cls, runner: ModelRunner) -> FusedDecodeStep | None:
        """The fused step for `runner`'s model, or None where it does not apply (another
        architecture, q/k norms, a linear of another kind or dtype, no kernels)."""
        from arborlm.runtime.models.llama import LlamaForCausalLM

        model = runner.model
        dtype = runner.kv_pool.dtype
        if type(model) is not LlamaForCausalLM or model.flags.qk_norm \
                or not cpu_kernels.available(dtype):
            return None
        spec = model.model.layers[0].self_attn.spec
        if not cpu_kernels.attention_fits(dtype, spec.num_heads // spec.num_kv_heads,
                                          spec.head_dim):
            return None
        weights: list[torch.Tensor | None] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [_panels(m, dtype) for m in (attn.qkv_proj, attn.o_proj,
                                                   mlp.gate_up_proj, mlp.down_proj)]
            if any(x is None for x in linears):
                return None
            (qkv, qkv_b), (o, o_b), (gu, gu_b), (down, down_b) = linears
            weights += [layer.input_layernorm.weight, qkv, qkv_b, o, o_b,
                        layer.post_attention_layernorm.weight, gu, gu_b, down, down_b]
        head = _panels(model.lm_head, dtype)
        if head is None or head[1] is not None:
            return None
        weights += [model.model.embed_tokens.weight, model.model.norm.weight, head[0]]
        return cls(runner, weights, model.model.layers[0].mlp.down_proj.in_features)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[B, vocab]` float32 of a decode batch that `decode_fits` (requests sharing a
        cached prefix included: cascade attention reads each group's prefix once)."""
        batch.attn_metadata = compiled_decode_metadata(batch)
        batch.logits_indices = None
        return self(batch, cascade_inputs(batch) if self.cascade else None)

    def run_ahead(self, batch: ForwardBatch, slots: torch.Tensor) -> torch.Tensor:
        """Greedy tokens `[S, B]` of S = len(slots) decode steps run as one C++ call
        (`arborlm::decode_steps`): step 0 is `batch`'s; step i feeds each request the argmax
        of step i-1 at the next position and writes its keys to `slots[i]`. The scheduler has
        written those slots to `req_to_token` (positions seq_lens - 1 + i) beforehand."""
        ahead = slots.shape[0] - 1
        batch.attn_metadata = compiled_decode_metadata(batch, ahead)
        batch.logits_indices = None
        meta: CompiledDecodeMeta = batch.attn_metadata
        cascade = cascade_inputs(batch, ahead) if self.cascade else None
        own, lens, prefix_slots, prefix_lens, groups = \
            cascade if cascade is not None else (meta.slots, meta.seq_lens, None, None, None)
        scale, heads, kv_heads, head_dim = self.shape
        return torch.ops.arborlm.decode_steps(
            batch.input_ids, batch.positions, slots, own, lens, self.weights, self.k_pool,
            self.v_pool, self.cos, self.sin, self.eps, scale, heads, kv_heads, head_dim,
            self.intermediate, prefix_slots, prefix_lens, groups)

    def __call__(self, batch: ForwardBatch, cascade: tuple | None = None) -> torch.Tensor:
        """Logits `[B, vocab]` float32 of a decode batch (metadata built), with the cascade
        groups `cascade_inputs` finds or without any."""
        meta: CompiledDecodeMeta = batch.attn_metadata
        scale, heads, kv_heads, head_dim = self.shape
        slots, lens, prefix_slots, prefix_lens, groups = \
            cascade if cascade is not None else (meta.slots, meta.seq_lens, None, None, None)
        return torch.ops.arborlm.decode_step(
            batch.input_ids, batch.positions, batch.out_cache_loc, slots, lens,
            self.weights, self.k_pool, self.v_pool, self.cos, self.sin, self.eps, scale, heads,
            kv_heads, head_dim, self.intermediate, prefix_slots, prefix_lens, groups)


def cascade_inputs(batch: ForwardBatch, ahead: int = 0) -> tuple | None:
    """The fused step's cascade groups, as `torch_native.find_groups` finds them for eager
    decode: (own slots `[B, W]` (each request's keys after its group's prefix), own lengths
    `[B]`, prefix slots `[G, P]`, prefix lengths `[G]`, group of each request `[B]` (-1: none)),
    or None where no group forms. Needs `compiled_decode_metadata` (with the same `ahead`: the
    own slots then also hold the positions of that many steps after this one)."""
    if batch.batch_size < 2 or not _shares_a_prefix(batch):  # the cheap test first
        return None
    meta: CompiledDecodeMeta = batch.attn_metadata
    width = meta.slots.shape[1]
    pos = torch.arange(width, device=meta.slots.device)
    held = batch.seq_lens + ahead
    slots = meta.slots * (pos[None, :] < held[:, None])  # padding -> slot 0
    layout = torch_native.find_groups(slots, batch.seq_lens_cpu)
    if layout.num_groups == 0:
        return None
    offsets = torch.tensor(layout.offsets, device=slots.device)
    own_lens = batch.seq_lens - offsets
    own_pos = (offsets[:, None] + pos[None, :int(own_lens.max()) + ahead]).clamp_(max=width - 1)
    first = [layout.groups.index(g) for g in range(layout.num_groups)]
    prefix_lens = [layout.offsets[i] for i in first]
    prefix_slots = slots[first, :layout.prefix_width].contiguous()
    return (slots.gather(1, own_pos), own_lens, prefix_slots,
            torch.tensor(prefix_lens, device=slots.device),
            torch.tensor(layout.groups, device=slots.device))


def _panels(linear: nn.Module, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A linear's weight in `cpu_kernels.pack_panels`' layout and its float32 bias, or None
    where it has none (a `PackedLinear` without panels, another module, another dtype)."""
    if isinstance(linear, PackedLinear):
        if linear.panels is None or linear.panels.dtype != dtype:
            return None
        return linear.panels, linear.bias32
    if not isinstance(linear, nn.Linear):  # a small one, left unpacked: panels of its own
        return None
    weight, bias = linear.weight.detach(), linear.bias
    if weight.dtype != dtype or weight.device.type != "cpu":
        return None
    return cpu_kernels.pack_panels(weight), None if bias is None else bias.detach().float()


def decode_fits(batch: ForwardBatch, max_bs: int, shared_prefix: bool = False) -> bool:
    """A decode step of at most `max_bs` requests, whose logits are wanted for every row,
    sharing no cached prefix unless `shared_prefix` (the fused step reads a shared prefix once
    per step for all its requests, as eager cascade attention does; the compiled graph would
    read it once per request)."""
    if not batch.mode.is_decode or batch.batch_size > max_bs:
        return False
    if not shared_prefix and batch.batch_size > 1 and _shares_a_prefix(batch):
        return False
    rows = batch.logits_indices
    return rows is None or rows.numel() == batch.batch_size


def _shares_a_prefix(batch: ForwardBatch) -> bool:
    """Whether two requests of the batch hold the same KV slot at the position from which
    `torch_native` would group them for cascade attention (a shared cached prefix: eager
    decode reads it once for the group; a compiled step would read it once per request)."""
    at = torch_native.CASCADE_MIN_PREFIX - 1
    rows = [r for r, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu) if n > at + 1]
    if len(rows) < 2:
        return False
    slots = batch.req_to_token_pool.req_to_token[rows, at].tolist()
    return len(set(slots)) < len(slots)


def create_compiled_decode_runner(runner: ModelRunner) -> CompiledDecodeRunner | None:
    """A `CompiledDecodeRunner` when `enable_torch_compile` is set and the device is a CPU."""
    args = runner.config.args
    if not args.enable_torch_compile:
        return None
    if runner.device != "cpu":
        logger.info("torch.compile decode is for CPU; on %s decode runs as before", runner.device)
        return None
    max_bs = min(args.torch_compile_max_bs, args.max_running_requests)
    start = time.perf_counter()
    compiled = CompiledDecodeRunner(runner, max_bs)
    logger.info("torch.compile decode on (batch sizes 1-%d), compiled in %.1f s", max_bs,
                time.perf_counter() - start)
    return compiled


def create_fused_decode_step(runner: ModelRunner) -> FusedDecodeStep | None:
    """The fused decode step for an engine without `enable_torch_compile` (which holds its own):
    on CPU, for the models and machines `FusedDecodeStep.of` takes. It needs no compiler, so
    eager engines decode through it too; `ModelRunner` runs it for steps that `decode_fits`."""
    args = runner.config.args
    if args.enable_torch_compile or args.disable_fused_decode or runner.device != "cpu":
        return None
    fused = FusedDecodeStep.of(runner)
    if fused is not None:
        logger.info("decode steps run as one C++ call (arborlm::decode_step)")
    return fused

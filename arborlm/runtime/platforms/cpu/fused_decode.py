"""`FusedDecodeStep`: a decode step of a Llama-family model as one C++ call (a decode executor).

`arborlm::decode_step` (`csrc/decode_step.cpp`) runs a whole step of a Llama, Llama 3, Mistral
or Qwen2 model (no q/k norms) over ArborLM's CPU kernels, with the eager model's arithmetic and
without the ~40 dispatcher calls and elementwise kernels of a compiled graph. It needs no
compiler, so eager engines and engines with `enable_torch_compile` alike decode through it
where it applies (`create_fused_decode`; the compiled graph then serves only the models it does
not take). It takes the steps whose requests share a cached prefix too, with cascade attention
of its own (`cascade_inputs`: each group's prefix read once per step, merged with the members'
own keys by log-sum-exp), and runs several greedy steps per call (`run_ahead`,
`arborlm::decode_steps`). `benchmarks/cpu_decode_step.py` compares it with the compiled graph.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from arborlm.runtime.decode_executor import DecodeExecutor, DecodeParts, decode_fits
from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.platforms.cpu import cascade
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.compiled_attention import (
    CompiledDecodeMeta,
    compiled_decode_metadata,
)
from arborlm.runtime.platforms.cpu.linear import PackedLinear

logger = logging.getLogger(__name__)


class FusedDecodeStep(DecodeExecutor):
    """The decode executor that runs a step of a Llama-family model (no q/k norm) as one C++
    call, `arborlm::decode_step`, for batches of up to `max_bs` requests."""

    def __init__(self, parts: DecodeParts, weights: list[torch.Tensor | None], intermediate: int,
                 max_bs: int):
        model = parts.model
        self.max_bs = max_bs
        self.intermediate = intermediate
        spec = model.model.layers[0].self_attn.spec
        self.weights = weights
        self.k_pool, self.v_pool = parts.kv_pool.k_buffer, parts.kv_pool.v_buffer
        self.cos, self.sin = model.model.rotary.cos, model.model.rotary.sin
        self.eps = model.model.norm.eps
        self.shape = (spec.scaling, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        # Deterministic inference has no cascade: a request's attention reads its own keys in
        # one pass, whoever shares them.
        self.cascade = not parts.deterministic

    @classmethod
    def of(cls, parts: DecodeParts, max_bs: int) -> FusedDecodeStep | None:
        """The fused step for `parts.model`, or None where it does not apply (another
        architecture, q/k norms, a linear of another kind or dtype, no kernels)."""
        from arborlm.runtime.models.llama import LlamaForCausalLM

        model = parts.model
        dtype = parts.kv_pool.dtype
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
        return cls(parts, weights, model.model.layers[0].mlp.down_proj.in_features, max_bs)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A decode step of at most `max_bs` requests that wants every row's logits (requests
        sharing a cached prefix included: cascade attention reads each group's prefix once)."""
        return decode_fits(batch, self.max_bs)

    def can_run_ahead(self, batch: ForwardBatch) -> bool:
        """Every step it runs, it can run ahead."""
        return self.can_run(batch)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[B, vocab]` float32 of a decode batch that `can_run`."""
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
        inputs = cascade_inputs(batch, ahead) if self.cascade else None
        own, lens, prefix_slots, prefix_lens, groups = \
            inputs if inputs is not None else (meta.slots, meta.seq_lens, None, None, None)
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
    """The fused step's cascade groups, as `cascade.find_groups` finds them for the CPU attention
    backend's decode: (own slots `[B, W]` (each request's keys after its group's prefix), own
    lengths `[B]`, prefix slots `[G, P]`, prefix lengths `[G]`, group of each request `[B]` (-1:
    none)), or None where no group forms. Needs `compiled_decode_metadata` (with the same `ahead`:
    the own slots then also hold the positions of that many steps after this one)."""
    if batch.batch_size < 2 or not cascade.shares_a_prefix(batch):  # the cheap test first
        return None
    meta: CompiledDecodeMeta = batch.attn_metadata
    width = meta.slots.shape[1]
    pos = torch.arange(width, device=meta.slots.device)
    held = batch.seq_lens + ahead
    slots = meta.slots * (pos[None, :] < held[:, None])  # padding -> slot 0
    layout = cascade.find_groups(slots, batch.seq_lens_cpu)
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


def _has_quant_linears(model: nn.Module) -> bool:
    from arborlm.runtime.platforms.cpu.quant_loading import has_quant_linears

    return has_quant_linears(model)


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


def create_fused_decode(parts: DecodeParts) -> FusedDecodeStep | None:
    """The fused decode executor on CPU, for the models and machines `FusedDecodeStep.of`
    takes, unless `disable_fused_decode`. It serves batches of up to `max_running_requests`,
    or `torch_compile_max_bs` with `enable_torch_compile` (the sizes a compiled step takes)."""
    args = parts.args
    if args.disable_fused_decode or parts.device != "cpu":
        return None
    if _has_quant_linears(parts.model):
        logger.info("the fused decode step is off: it reads float weights, and the decoder's "
                    "linears compute from packed GGUF blocks (--quantization)")
        return None
    max_bs = min(args.torch_compile_max_bs, args.max_running_requests) \
        if args.enable_torch_compile else args.max_running_requests
    fused = FusedDecodeStep.of(parts, max_bs)
    if fused is not None:
        logger.info("decode steps run as one C++ call (arborlm::decode_step)")
    return fused

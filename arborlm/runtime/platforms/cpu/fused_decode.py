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

Weights kept in GGUF's packed blocks (`--quantization`: `QuantLinear`, `QuantLinearStack`,
`QuantEmbedding`) go in as they are, with records naming their types (`PackedWeights`); the step
computes them with the eager modules' kernels and conversions, on the one `quant_linear` path
the eager modules would take for the batch's rows (or the path deterministic inference pinned).
On a CPU with AVX2 but not AVX-512 the step serves float32 models whose linears are all packed
(`cpu_kernels.packed_step_available`): its attention and row steps take AVX2 forms there (sums
in other orders than the eager torch ops', so logits agree to float32 rounding), without
cascade groups.
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

    def __init__(self, parts: DecodeParts, weights: PackedWeights, intermediate: int,
                 max_bs: int):
        model = parts.model
        self.max_bs = max_bs
        self.intermediate = intermediate
        spec = model.model.layers[0].self_attn.spec
        self.weights = weights.tensors + weights.extra
        self.packed = weights.records
        self.pinned_path = weights.pinned_path
        self.k_pool, self.v_pool = parts.kv_pool.k_buffer, parts.kv_pool.v_buffer
        self.cos, self.sin = model.model.rotary.cos, model.model.rotary.sin
        self.eps = model.model.norm.eps
        self.shape = (spec.scaling, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        # Deterministic inference has no cascade: a request's attention reads its own keys in
        # one pass, whoever shares them. Nor has a CPU without AVX-512 (its prefix kernel).
        self.cascade = not parts.deterministic and cpu_kernels.available(parts.kv_pool.dtype)

    @classmethod
    def of(cls, parts: DecodeParts, max_bs: int) -> FusedDecodeStep | None:
        """The fused step for `parts.model`, or None where it does not apply (another
        architecture, q/k norms, a linear of another kind or dtype, no kernels; without
        AVX-512, a float linear or a dtype other than float32)."""
        from arborlm.runtime.models.llama import LlamaForCausalLM

        model = parts.model
        dtype = parts.kv_pool.dtype
        if type(model) is not LlamaForCausalLM or model.flags.qk_norm \
                or not cpu_kernels.packed_step_available(dtype):
            return None
        spec = model.model.layers[0].self_attn.spec
        if not cpu_kernels.attention_fits(dtype, spec.num_heads // spec.num_kv_heads,
                                          spec.head_dim):
            return None
        weights = PackedWeights(10 * len(model.model.layers) + 3,
                                panels=cpu_kernels.available(dtype))
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights.tensors.append(layer.input_layernorm.weight)
            if not (weights.add_linear(attn.qkv_proj, dtype)
                    and weights.add_linear(attn.o_proj, dtype)):
                return None
            weights.tensors.append(layer.post_attention_layernorm.weight)
            if not (weights.add_linear(mlp.gate_up_proj, dtype)
                    and weights.add_linear(mlp.down_proj, dtype)):
                return None
        if not weights.add_embedding(model.model.embed_tokens, dtype):
            return None
        weights.tensors.append(model.model.norm.weight)
        if not weights.add_linear(model.lm_head, dtype, bias=False):
            return None
        if weights.records and not weights.paths_agree():
            return None
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
            self.intermediate, prefix_slots, prefix_lens, groups, self.packed,
            self.quant_path(batch.batch_size))

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
            kv_heads, head_dim, self.intermediate, prefix_slots, prefix_lens, groups,
            self.packed, self.quant_path(batch.batch_size))

    def quant_path(self, rows: int) -> str:
        """The path of the packed linears for a step of `rows` requests: the one the eager
        `QuantLinear`s would take (pinned, or chosen by rows); "" without packed weights."""
        if not self.packed:
            return ""
        return self.pinned_path or cpu_kernels.quant_path(rows)


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


class PackedWeights:
    """The fused step's weights (`csrc/decode_step.cpp`'s order) as they are gathered: float
    linears as panels, packed GGUF modules as their blocks with a record each (`records`: weight
    index, kind, parts, (tensor index, ggml type) per part), a stack's later parts in `extra`
    (after the `standard` entries)."""

    def __init__(self, standard: int, panels: bool = True):
        self.standard = standard
        self.panels = panels  # whether float linears can go in as panels (AVX-512)
        self.tensors: list[torch.Tensor | None] = []
        self.extra: list[torch.Tensor] = []
        self.records: list[int] = []
        self.paths: set[str | None] = set()

    def add_linear(self, linear: nn.Module, dtype: torch.dtype, bias: bool = True) -> bool:
        """Append `linear`'s weight (and its bias slot, with `bias`); False where the step
        cannot take it."""
        from arborlm.runtime.platforms.cpu.quant_linear import QuantLinear
        from arborlm.runtime.platforms.cpu.quant_stack import QuantLinearStack

        index = len(self.tensors)
        if isinstance(linear, QuantLinear | QuantLinearStack):
            if not bias and linear.bias is not None:
                return False
            stack = isinstance(linear, QuantLinearStack)
            parts = list(linear.parts) if stack else [linear]
            self.records += [index, int(stack), len(parts), index, int(parts[0].qtype)]
            for part in parts[1:]:
                self.records += [self.standard + len(self.extra), int(part.qtype)]
                self.extra.append(part.blocks)
            self.paths.update(part.path for part in parts)
            self.tensors += [parts[0].blocks, linear.bias] if bias else [parts[0].blocks]
            return True
        panels = _panels(linear, dtype) if self.panels else None
        if panels is None or (not bias and panels[1] is not None):
            return False
        self.tensors += list(panels) if bias else [panels[0]]
        return True

    def add_embedding(self, embedding: nn.Module, dtype: torch.dtype) -> bool:
        """Append the token embedding (float rows, or `QuantEmbedding`'s packed rows)."""
        from arborlm.runtime.platforms.cpu.quant_embedding import QuantEmbedding

        index = len(self.tensors)
        if isinstance(embedding, QuantEmbedding):
            if embedding.dtype != dtype or embedding.embedding_dim % 32:
                return False
            self.records += [index, 2, 1, index, int(embedding.qtype)]
            self.tensors.append(embedding.blocks)
            return True
        weight = getattr(embedding, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype != dtype:
            return False
        self.tensors.append(weight)
        return True

    def paths_agree(self) -> bool:
        """Whether the packed linears run one path: all chosen per call, or all pinned to one
        (deterministic inference pins them all), and the packed kernels are built."""
        return len(self.paths) == 1 and cpu_kernels.quant_linear_available()

    @property
    def pinned_path(self) -> str | None:
        return next(iter(self.paths)) if len(self.paths) == 1 else None


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
    max_bs = min(args.torch_compile_max_bs, args.max_running_requests) \
        if args.enable_torch_compile else args.max_running_requests
    fused = FusedDecodeStep.of(parts, max_bs)
    if fused is not None:
        logger.info("decode steps run as one C++ call (arborlm::decode_step)")
    return fused

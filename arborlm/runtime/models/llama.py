"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

One implementation serves all four; `_ArchFlags` holds the differences read from the config.
The model works on a flat batch of new tokens (`ForwardBatch`): every request's tokens are
concatenated into `[T]`, positions come from the batch, and attention (with the KV cache) is
delegated to the batch's attention backend, so the model never sees padding or cache layout.

For CPU speed the q/k/v projections are one matmul (`qkv_proj`) and gate/up another
(`gate_up_proj`); checkpoints store them separately and `load_weights` copies each into its rows.
Cos/sin come from a table indexed once per step; the last layer runs its MLP only on the rows
whose logits are wanted. Numerics follow `transformers` op for op (RMSNorm in float32, residual
adds and rotary in the activation dtype) so bfloat16 results match the reference closely.

Tensor parallelism (given a `TPGroup`): each rank builds only its shard (`distributed/shard.py`:
its heads, KV heads, MLP columns and vocabulary rows), sums the outputs of o_proj and down_proj
over the ranks (the row-parallel linears' all-reduce), looks tokens up in its embedding rows
(zeros elsewhere, summed over the ranks) and gathers the LM head's logits from every rank.

Not here: sampling, the KV pool, batching, sliding-window attention (a model whose window is
shorter than the context raises `ModelLoadError`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import skip_init

from arborlm.errors import ModelLoadError
from arborlm.runtime.attention.base import AttentionLayerSpec
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.distributed.group import TPGroup
from arborlm.runtime.distributed.shard import TPShard
from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.layers.activation import silu_and_mul
from arborlm.runtime.layers.norm import RMSNorm
from arborlm.runtime.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters

# The fused linears and the checkpoint linears whose rows they stack, in order.
STACKED_LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                   "gate_up_proj": ("gate_proj", "up_proj")}
# Checkpoint tensors that carry no weights of ours (old Llama checkpoints saved this buffer).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class _ArchFlags:
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, config: ModelConfig) -> _ArchFlags:
        hf = config.hf_config
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(qkv_bias=attention_bias or config.architecture == "qwen2",
                   o_bias=attention_bias and config.architecture != "qwen2",
                   mlp_bias=bool(hf.get("mlp_bias", False)),
                   qk_norm=config.architecture == "qwen3")


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
            device: str | torch.device | None = None) -> nn.Linear:
    """An `nn.Linear` with uninitialised weights (they are loaded), on the default device."""
    return skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype,
                     device=device or torch.get_default_device())


def _check_sliding_window(config: ModelConfig) -> None:
    hf = config.hf_config
    if config.hf_config.get("model_type") == "mistral":
        window = hf.get("sliding_window", 4096)  # transformers' MistralConfig default
    else:
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is not None and window < config.context_length:
        raise ModelLoadError(
            f"{config.path}: sliding-window attention (window {window}) is not supported; set "
            f"context_length <= {window} to run it with full attention, which is identical "
            f"within the window")


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, flags: _ArchFlags, shard: TPShard,
                 tp: TPGroup | None):
        super().__init__()
        self.tp = tp
        heads, kv_heads, head_dim = shard.num_heads, shard.num_kv_heads, config.head_dim
        self.q_size = heads * head_dim
        self.kv_size = kv_heads * head_dim
        self.spec = AttentionLayerSpec(layer_id, heads, kv_heads, head_dim, head_dim ** -0.5)
        self.qkv_proj = _linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                flags.qkv_bias, config.dtype)
        self.o_proj = _linear(self.q_size, config.hidden_size, flags.o_bias, config.dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if flags.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, config.dtype)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, config.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        spec = self.spec
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2*Hkv) * D]
        qk_end = self.q_size + self.kv_size
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, :self.q_size].view(n, spec.num_heads, spec.head_dim))
            k = self.k_norm(qkv[:, self.q_size:qk_end].view(n, spec.num_kv_heads, spec.head_dim))
            q = apply_rotary(q, cos, sin)  # [T, H, D]
            k = apply_rotary(k, cos, sin)  # [T, Hkv, D]
        else:
            qk = qkv[:, :qk_end].view(n, spec.num_heads + spec.num_kv_heads, spec.head_dim)
            qk = apply_rotary(qk, cos, sin)  # [T, H + Hkv, D], one rotation for q and k
            q, k = qk[:, :spec.num_heads], qk[:, spec.num_heads:]
        v = qkv[:, qk_end:]  # [T, Hkv * D]
        out = batch.attn_backend.forward(q.flatten(1), k.flatten(1), v, spec, batch)
        out = self.o_proj(out)  # [T, hidden]; this rank's heads' part of it
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, flags: _ArchFlags, shard: TPShard,
                 tp: TPGroup | None):
        super().__init__()
        self.tp = tp
        inter = shard.intermediate_size
        self.gate_up_proj = _linear(config.hidden_size, 2 * inter, flags.mlp_bias, config.dtype)
        self.down_proj = _linear(inter, config.hidden_size, flags.mlp_bias, config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, hidden], partial sum
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, flags: _ArchFlags, shard: TPShard,
                 tp: TPGroup | None):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, flags, shard, tp)
        self.mlp = LlamaMLP(config, flags, shard, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                config.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, batch: ForwardBatch,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` is the previous layer's MLP output (or the embeddings, with `residual` None).

        Returns `(mlp_output, residual)`; their sum is this layer's output. With `keep`, only
        those rows go on past attention (the K/V of every row is still written).
        """
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h = self.self_attn(h, cos, sin, batch)  # [T, hidden]
        if keep is not None:
            h, residual = h[keep], residual[keep]  # [N, hidden]
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, flags: _ArchFlags, shard: TPShard,
                 tp: TPGroup | None):
        super().__init__()
        self.tp, self.shard = tp, shard
        # Given its weight, nn.Embedding skips its random init (the weights are loaded).
        weight = torch.empty(shard.vocab_rows, config.hidden_size, dtype=config.dtype)
        self.embed_tokens = nn.Embedding(shard.vocab_rows, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, flags, shard, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        hf = config.hf_config
        self.rotary = RotaryEmbedding(config.head_dim, config.context_length, rope_parameters(hf),
                                      config.dtype, hf.get("max_position_embeddings", 4096))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self._embed(batch.input_ids)  # [T, hidden]
        cos, sin = self.rotary.lookup(batch.positions)  # [T, 1, D] each
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            keep = batch.logits_indices if i == last else None
            x, residual = layer(x, residual, cos, sin, batch, keep)
        out, _ = self.norm.forward_with_residual(x, residual)
        return out  # [N, hidden]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings `[T, hidden]`; with tensor parallelism each rank looks up the ids in its
        vocabulary rows, zeros for the others, and the sum over the ranks is exact."""
        if self.tp is None:
            return self.embed_tokens(ids)
        local = ids - self.shard.vocab_start  # [T]
        outside = (local < 0) | (local >= self.shard.vocab_rows)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(1), 0)
        return self.tp.all_reduce(x)


class LlamaForCausalLM(nn.Module):
    """Causal LM head over `LlamaModel`; parameter names mirror Hugging Face's."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        _check_sliding_window(config)
        self.config = config
        self.tp = tp
        self.shard = TPShard.of(config) if tp is None else TPShard.of(config, tp.rank, tp.size)
        self.flags = _ArchFlags.of(config)
        self.model = LlamaModel(config, self.flags, self.shard, tp)
        tied = config.tie_word_embeddings
        # A tied head gets its weight from the embedding; build it on "meta" to allocate nothing.
        self.lm_head = _linear(config.hidden_size, self.shard.vocab_rows, False, config.dtype,
                               device="meta" if tied else None)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states `[N, hidden]` of rows `batch.logits_indices` (all if None)."""
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[N, hidden]` -> logits `[N, vocab]` float32 (matmul in the model dtype);
        with tensor parallelism every rank gets the whole row, gathered from the ranks."""
        logits = self.lm_head(hidden).float()  # [N, vocab rows of this rank]
        if self.tp is None:
            return logits
        return self.tp.all_gather_last(logits)[:, :self.config.vocab_size]  # [N, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters.

        Separate q/k/v and gate/up tensors land in their rows of the fused projections.
        Raises `ModelLoadError` naming the tensor for an unknown name, a shape mismatch, or any
        parameter the checkpoint did not provide.
        """
        targets = self._weight_targets()
        pending = set(targets)
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the head is the embedding matrix
            if name not in targets:
                raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint: not a "
                                     f"parameter of a {self.config.architecture} model")
            param, rows = targets[name]
            tensor = self.shard.take(name, tensor)
            dst = param.data if rows is None else param.data[rows]
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the "
                                     f"model expects {tuple(dst.shape)}")
            dst.copy_(tensor)
            pending.discard(name)
        if pending:
            missing = sorted(pending)
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _weight_targets(self) -> dict[str, tuple[nn.Parameter, slice | None]]:
        """Checkpoint tensor name -> (parameter, rows of it that tensor fills, None = all)."""
        s = self.shard
        q, kv, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter}
        stacked = {}
        for fused, parts in STACKED_LINEARS.items():
            ends = [sum(sizes[p] for p in parts[:i + 1]) for i in range(len(parts))]
            stacked[fused] = tuple((p, end - sizes[p], end) for p, end in zip(parts, ends))
        targets: dict[str, tuple[nn.Parameter, slice | None]] = {}
        for name, param in self.named_parameters():  # a tied lm_head is listed once, as embed
            module_path, _, leaf = name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            if module not in stacked:
                targets[name] = (param, None)
                continue
            for ckpt_module, start, end in stacked[module]:
                targets[f"{parent}.{ckpt_module}.{leaf}"] = (param, slice(start, end))
        return targets

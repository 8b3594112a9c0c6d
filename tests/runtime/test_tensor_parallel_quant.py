"""Tensor parallelism with `--quantization`: each rank computes from its own blocks of the packed
weights, split on block boundaries, and the engine's greedy tokens equal one rank's.

Two levels. Each rank's `QuantLinear`s hold exactly its part of the whole model's blocks (decoded,
they equal the float shard `TPShard.take` cuts from the whole decoded weight) for every type
quantized at load and for a GGUF file's packed blocks. Then real engines (gloo ranks on loopback):
TP=2 greedy tokens equal TP=1's with the same quantized weights. The sharded sums are the same
products as one rank's, added in another order (the all-reduce), so the logprobs agree to float32
rounding on `quant_linear`'s portable path (measured with every rank forced onto it: within 7e-6
here, 1.5e-5 on SmolLM2 over 3 ranks). On the VNNI path the kernel also rounds each block of
activations to int8, and a last-bit difference in a layer's input can move one of those
roundings, which then carries through the layers (measured: up to 0.032 on the Q4_0 file, 0.078
on SmolLM2's 30 layers; the tokens equal), the same scale as that path's own error against the
float model (`test_cpu_quant_loading.py`). A tp size whose row-parallel shards would cut a block
is refused before any rank starts, naming both sizes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T

from arborlm import Engine
from arborlm.errors import ModelLoadError
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.models.factory import tiny_model
from arborlm.runtime.models.llama import STACKED_LINEARS
from arborlm.runtime.models.registry import load_model
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.quant_embedding import QuantEmbedding
from arborlm.runtime.platforms.cpu.quant_linear import QuantLinear
from tests.runtime.gguf_writer import write_gguf
from tests.runtime.test_gguf_models import SIZE
from tests.runtime.test_tensor_parallel import _assert_same, _generate

# Summation order alone (portable, and the float paths), or with the int8 roundings it can move:
# two-term int8 activations (vnni2, and avx2_int without AVX-512: decode by default) round at
# 2^-15 of a block's scale, one int8 term (vnni, opt-in) at 2^-7 (module docstring).
LOGPROB_TOL = {"portable": 1e-4, "avx2": 1e-4, "bf16": 1e-4, "float": 1e-4, "vnni2": 1e-3,
               "avx2_int": 1e-3, "vnni": 0.25}[cpu_kernels.quant_path()]
# Q4_K's 256-value blocks: head_dim 128 keeps each of 2 ranks' o_proj input (2 heads) whole.
K_QUANT_SIZE = {"hidden_size": 512, "intermediate_size": 1024, "num_heads": 4, "num_kv_heads": 2}


def _whole_and_shards(config: ModelConfig, quantization: str, size: int
                      ) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The whole model and each rank's shard, loaded with `quantization` (no group is joined:
    loading needs only the rank and the size)."""
    shards = [load_model(config, tp=SimpleNamespace(rank=r, size=size),  # type: ignore[arg-type]
                         quantization=quantization) for r in range(size)]
    return load_model(config, quantization=quantization), shards


def _float_shard(shard: torch.nn.Module, name: str, whole: torch.Tensor) -> torch.Tensor:
    """`TPShard.take` of the whole decoded weight of linear `name`, its stacked parts each cut
    as the checkpoint's tensor would be."""
    parent, _, leaf = name.rpartition(".")
    parts = STACKED_LINEARS.get(leaf, (leaf,))
    pieces, start = [], 0
    for part in parts:
        rows = whole.shape[0] // len(parts)
        if leaf == "qkv_proj":
            cfg = shard.config
            rows = (cfg.num_heads if part == "q_proj" else cfg.num_kv_heads) * cfg.head_dim
        pieces.append(shard.shard.take(f"{parent}.{part}.weight", whole[start:start + rows]))
        start += rows
    return torch.cat(pieces)


def _assert_blocks_are_the_shards(config: ModelConfig, quantization: str, size: int) -> None:
    whole, shards = _whole_and_shards(config, quantization, size)
    layers = {n: m for n, m in whole.model.layers.named_modules(prefix="model.layers")
              if isinstance(m, QuantLinear)}
    assert len(layers) == 4 * config.num_layers
    for shard in shards:
        for name, layer in layers.items():
            part = shard.get_submodule(name)
            assert isinstance(part, QuantLinear) and part.qtype == layer.qtype, name
            want = _float_shard(shard, name, layer.dequantized())
            assert torch.equal(part.dequantized(), want), (shard.shard.rank, name)
        # The packed embedding and head: this rank's vocabulary rows, zeros past the vocabulary.
        table = whole.model.embed_tokens
        assert isinstance(table, QuantEmbedding) and isinstance(whole.lm_head, QuantLinear)
        start, rows = shard.shard.vocab_start, shard.shard.vocab_rows
        want = torch.zeros(rows, config.hidden_size)
        mine = table.dequantized(torch.float32)[start:start + rows]
        want[:mine.shape[0]] = mine
        assert torch.equal(shard.model.embed_tokens.dequantized(torch.float32), want)
        head = whole.lm_head.dequantized()[start:start + rows]
        assert torch.equal(shard.lm_head.dequantized()[:head.shape[0]], head)


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_each_rank_quantizes_its_shard_to_the_whole_models_blocks(make_tiny_model, quantization):
    config = ModelConfig.from_path(make_tiny_model("llama"), "float32")
    _assert_blocks_are_the_shards(config, quantization, 2)


@pytest.mark.parametrize("arch, qtype, size", [("llama", T.Q4_K, K_QUANT_SIZE),
                                               ("qwen2", T.Q5_0, SIZE)],
                         ids=["llama-q4_k", "qwen2-q5_0"])
def test_each_rank_keeps_its_blocks_of_a_gguf_file(arch, qtype, size, tmp_path):
    """Rows of q/k/v and gate/up, whole 256-value (Q4_K) or 32-value (Q5_0) blocks of o/down."""
    path = write_gguf(tiny_model(arch, **size), tmp_path / f"{arch}.gguf", qtype)
    _assert_blocks_are_the_shards(ModelConfig.from_path(path, "float32"), "gguf", 2)


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1"])
def test_tp2_quantized_at_load_greedy_equals_tp1(make_tiny_model, quantization):
    path = make_tiny_model("llama")
    _assert_same(_generate(path, quantization=quantization),
                 _generate(path, quantization=quantization, tp_size=2), LOGPROB_TOL)


def test_tp2_gguf_packed_greedy_equals_tp1(tmp_path):
    path = write_gguf(tiny_model("qwen2", **SIZE), tmp_path / "qwen2.gguf", T.Q4_0)
    _assert_same(_generate(path, quantization="gguf"),
                 _generate(path, quantization="gguf", tp_size=2), LOGPROB_TOL)


def test_a_shard_that_cuts_a_block_is_refused_naming_both_sizes(make_tiny_model, tmp_path):
    """Tiny llama: 4 heads of 16 over 4 ranks leave o_proj 16 input values a rank (Q8_0 blocks
    hold 32); a Q4_K file with heads of 64 over 2 ranks leaves 128 (its blocks hold 256)."""
    with pytest.raises(ModelLoadError, match=r"tp_size 4 cuts Q8_0 blocks of 32 values: each "
                                             r"rank's o_proj input of 16 values"):
        Engine(str(make_tiny_model("llama")), dtype="float32", quantization="q8_0", tp_size=4)
    path = write_gguf(tiny_model("llama", **SIZE), tmp_path / "llama.gguf", T.Q4_K)
    with pytest.raises(ModelLoadError, match=r"tp_size 2 cuts Q4_K blocks of 256 values: each "
                                             r"rank's o_proj input of 128 values"):
        Engine(str(path), dtype="float32", quantization="gguf", tp_size=2)

"""`--quantization` on a tiny random Llama: the engine computes from packed blocks, and its
logits follow the same model computed in float32 from the dequantized weights.

The reference is ArborLM's own float32 model (equal to transformers' to float32 rounding,
`test_model_numerics.py`) with every quantized linear's weight replaced by its blocks decoded.
What remains between the two is the packed kernel's arithmetic: on AVX512-VNNI CPUs the
activations are quantized to int8 per 32-value block (as llama.cpp does). A random model's
logits are flat (top-1 probability ~7%, median margin to the second 0.2-0.35 nats), so top-1
flips far more than on real text (measured: 87% agreement with Q8_0): the tests hold KL divergence
to the issue's 0.01 (measured 0.0012 with Q8_0 and Q4_0), top-1 agreement to 80%, and every
flip to a near-tie: the token picked is within 0.3 nats of the reference's best (measured up to
0.05 / 0.08 nats in the logits test, 0.01 / 0.21 through the engine, Q8_0 / Q4_0).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import arborlm
from arborlm.errors import InvalidRequestError, ModelLoadError
from arborlm.runtime.config import EngineArgs, ModelConfig
from arborlm.runtime.models.factory import tiny_model
from arborlm.runtime.models.registry import load_model
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.quant_embedding import QuantEmbedding
from arborlm.runtime.platforms.cpu.quant_linear import QuantLinear
from arborlm.runtime.platforms.cpu.quant_stack import QuantLinearStack
from tests.runtime.model_harness import ModelHarness
from tests.runtime.test_cpu_quant_linear import _skip_unless

QUANTIZATIONS = ["q8_0", "q4_0"]


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(6, 512, (n,), generator=gen).tolist()


def _models(path, quantization: str) -> tuple[ModelConfig, torch.nn.Module, torch.nn.Module]:
    """(config, the model loaded with `quantization`, the float32 one with its decoded weights)."""
    config = ModelConfig.from_path(path, "float32")
    quantized = load_model(config, quantization=quantization)
    ref = load_model(config)
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 4 * config.num_layers + 1  # qkv, o, gate_up, down; the head
    assert layers["lm_head"].qtype.name == "Q8_0"
    embedding = quantized.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding) and embedding.qtype.name == "Q8_0"
    if config.tie_word_embeddings:
        assert layers["lm_head"].blocks is embedding.blocks  # one table
    for name, layer in layers.items():
        assert not hasattr(layer, "weight")
        ref.get_submodule(name).weight.copy_(layer.dequantized())
    ref.model.embed_tokens.weight.copy_(embedding.dequantized())
    return config, quantized, ref


def _log_probs(model: torch.nn.Module, config: ModelConfig, prompt: list[int],
               more: list[int]) -> torch.Tensor:
    """Log-probabilities `[len(prompt) + len(more), vocab]`: `prompt` in one extend step, then
    each token of `more` decoded on its own."""
    h = ModelHarness(model, config)
    row = h.new_request()
    steps = [h.extend([row], [prompt])] + [h.decode([row], [t]) for t in more]
    return torch.cat(steps).log_softmax(-1)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_extend_and_decode_logits_follow_the_dequantized_model(make_tiny_model, quantization):
    _skip_unless("portable")
    config, quantized, ref = _models(make_tiny_model("llama"), quantization)
    prompt, more = _tokens(40, seed=1), _tokens(12, seed=2)
    got = _log_probs(quantized, config, prompt, more)
    want = _log_probs(ref, config, prompt, more)
    kl = (want.exp() * (want - got)).sum(-1)  # [positions]
    picked = got.argmax(-1, keepdim=True)
    agree = (picked[:, 0] == want.argmax(-1)).float()
    loss = want.max(-1).values - want.gather(-1, picked)[:, 0]  # nats the flips give up
    assert kl.mean() <= 0.01 and agree.mean() >= 0.8, (kl.mean().item(), agree.mean().item())
    assert loss.max() <= 0.3, loss.max().item()
    if quantization == "q4_0":  # the reference is the quantized model, not the float one
        float_model = _log_probs(load_model(config), config, prompt, more)
        kl_float = (float_model.exp() * (float_model - got)).sum(-1).mean()
        assert kl_float >= 10 * kl.mean(), (kl_float.item(), kl.mean().item())  # 0.25 vs 0.0012
    assert kl[len(prompt):].mean() <= 0.01  # the decode steps alone


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_engine_greedy_tokens_follow_the_dequantized_model(make_tiny_model, quantization):
    """Through the Engine API (prefill, then eager decode steps): each greedy token is the
    dequantized model's top-1 at that position (teacher-forced) in >= 80% of steps and within
    0.3 nats of it in every step, and its reported logprob is within 0.05 of that model's on
    average (measured: 96% / 90% agreement, mean gap 0.036, Q8_0 / Q4_0)."""
    _skip_unless("portable")
    path = make_tiny_model("llama")
    config, _, ref = _models(path, quantization)
    prompts = [_tokens(n, seed=10 + n) for n in (9, 23, 31)]
    engine = arborlm.Engine(model_path=str(path), dtype="float32", quantization=quantization)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 16, "ignore_eos": True}, return_logprob=True)
    finally:
        engine.shutdown()
    agree, gaps, losses = [], [], []
    for prompt, out in zip(prompts, outs):
        ids = out["output_ids"]
        want = _log_probs(ref, config, prompt + ids[:-1], [])[len(prompt) - 1:]  # [16, vocab]
        agree += (want.argmax(-1) == torch.tensor(ids)).tolist()
        losses += (want.max(-1).values - want[torch.arange(len(ids)), ids]).tolist()
        got = torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]])
        gaps += (got - want[torch.arange(len(ids)), ids]).abs().tolist()
    assert sum(agree) >= 0.8 * len(agree) and max(losses) <= 0.3, (agree, losses)
    assert sum(gaps) / len(gaps) <= 0.05, gaps


@pytest.mark.parametrize("args, reason", [
    ({"quantization": "q3_k"}, "must be one of"),
    ({"quantization": "q4_0", "device": "cuda"}, "CPU only"),
    ({"quantization": "q8_0", "dtype": "float16"}, "float32 or bfloat16"),
    ({"quantization": "gguf"}, "not one"),
])
def test_options_it_cannot_apply_to_are_refused_naming_it(make_tiny_model, args, reason):
    with pytest.raises(InvalidRequestError, match=reason) as e:
        EngineArgs(model_path=str(make_tiny_model("llama")), **args).resolve()
    assert e.value.param == "quantization"


def test_without_its_operators_it_is_refused_naming_why(make_tiny_model, monkeypatch):
    monkeypatch.setenv("ARBORLM_CPU_KERNELS", "0")
    with pytest.raises(InvalidRequestError, match="CPU operators are not available") as e:
        EngineArgs(model_path=str(make_tiny_model("llama")), quantization="q4_0").resolve()
    assert e.value.param == "quantization"
    config = ModelConfig.from_path(make_tiny_model("llama"), "float32")
    with pytest.raises(ModelLoadError, match="quantization q4_0: ArborLM's CPU operators"):
        load_model(config, quantization="q4_0")  # not past the engine's check only


_FRESH_ENGINE = """
import json, sys
import arborlm
engine = arborlm.Engine(model_path=sys.argv[1], dtype="float32", quantization="q4_0")
out = engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={
    "temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
engine.shutdown()
print(json.dumps(out[0]["output_ids"]))
"""


def test_a_quantized_engine_loads_its_operators_itself(make_tiny_model):
    """In a fresh interpreter nothing else has loaded ArborLM's operators (on a CPU without
    AVX-512 no other kernel asks for them): the engine must, not die at its first step with
    `torch.ops.arborlm` lacking `quant_linear`. Its tokens equal this process's engine's."""
    _skip_unless("portable")
    path = str(make_tiny_model("llama"))
    run = subprocess.run([sys.executable, "-c", _FRESH_ENGINE, path], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    engine = arborlm.Engine(model_path=path, dtype="float32", quantization="q4_0")
    try:
        want = engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={
            "temperature": 0, "max_new_tokens": 6, "ignore_eos": True})[0]["output_ids"]
    finally:
        engine.shutdown()
    assert json.loads(run.stdout.strip().splitlines()[-1]) == want


@pytest.mark.parametrize("arch, qtype", [("llama", "Q4_K"), ("qwen2", "Q4_0")])
def test_gguf_linears_stay_packed_and_compute_like_the_decoded_file(arch, qtype, tmp_path,
                                                                    monkeypatch):
    """`--quantization gguf` on a written file: every decoder linear becomes a QuantLinear of
    the file's own blocks (llama: q/k rows un-interleaved as whole block rows; qwen2: q/k/v
    biases loaded into the QuantLinear), the embedding a QuantEmbedding and the head a
    QuantLinear; layer 0's attn_v is stored as Q8_0 against the others' type, so its stacked
    q/k/v is a QuantLinearStack of the two types. On the
    portable path (blocks decoded to float32) the logits equal the decoded file's model."""
    _skip_unless("portable")
    from gguf import GGMLQuantizationType as T

    from tests.runtime.gguf_writer import write_gguf
    from tests.runtime.test_gguf_models import SIZE

    path = write_gguf(tiny_model(arch, **SIZE), tmp_path / f"{arch}.gguf", T[qtype],
                      zero_typed={"blk.0.attn_v.weight": T.Q8_0})
    monkeypatch.setattr(cpu_kernels, "quant_path", lambda rows=1: "portable")
    config = ModelConfig.from_path(path, "float32")
    quantized, ref = load_model(config, quantization="gguf"), load_model(config)
    packed = {n: m for n, m in quantized.named_modules() if isinstance(m, QuantLinear)}
    stack = quantized.model.layers[0].self_attn.qkv_proj
    assert isinstance(stack, QuantLinearStack)  # q/k in the file's type, then v in Q8_0
    assert [(p.qtype.name, p.out_features) for p in stack.parts] == [
        (qtype, stack.out_features - config.num_kv_heads * config.head_dim),
        ("Q8_0", config.num_kv_heads * config.head_dim)]
    assert len(packed) == 4 * config.num_layers + 2  # the stack's 2 parts, and the head
    assert not config.tie_word_embeddings  # the file has an output tensor of its own
    assert isinstance(quantized.model.embed_tokens, QuantEmbedding)
    assert {m.qtype.name for n, m in packed.items() if ".layers.0.self_attn.qkv" not in n} \
        == {qtype}
    if arch == "qwen2":  # the stack's bias: loaded over all its rows
        torch.testing.assert_close(stack.bias, ref.model.layers[0].self_attn.qkv_proj.bias)
    if arch == "qwen2":
        qkv = quantized.model.layers[1].self_attn.qkv_proj
        torch.testing.assert_close(qkv.bias, ref.model.layers[1].self_attn.qkv_proj.bias)
    ids = _tokens(24, seed=3)
    got = _log_probs(quantized, config, ids[:20], ids[20:])
    want = _log_probs(ref, config, ids[:20], ids[20:])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

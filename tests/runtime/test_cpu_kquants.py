"""Q4_K and Q6_K quantization at load (`kquants.py`, `--quantization q4_k` / `q6_k`).

- Round trip against the float64 reference decoder (`gguf_reference.py`, ggml's loops): every
  value within a bound of its sub-block's own step (Q4_K: range / 15, Q6_K: max|x| / 31) plus
  the rounding of the sub-block scales to the super-block's 6- or 8-bit grid (Q4_K: 8 steps of
  d = largest scale / 63 and one of dmin; Q6_K: max|x| of the super-block / 128), on rows with
  zeros, a constant, one sign only, an outlier 800x the rest and a sub-block 1e-5x its
  neighbours. The `gguf` package's own decoder reads the bytes to the same values.
- Against llama.cpp's reference quantizer (`quantize_row_q4_K_ref` / `_q6_K_ref` from the
  ggml library llama-cpp-python ships; skipped without it): squared error within 1% of
  ggml's, the bytes almost all identical (float32 sums in another order flip a few near-ties).
- The packed kernel reads these blocks: `QuantLinear` on them equals the float64 product with
  the decoded weight (portable path), and a tiny model quantized with `q4_k` gets llama.cpp's
  Q4_K_M mix and follows its dequantized self.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from arborlm.runtime.config import ModelConfig
from arborlm.runtime.models.factory import tiny_model
from arborlm.runtime.models.registry import load_model
from arborlm.runtime.platforms.cpu.kquants import quantize_q4_k, quantize_q6_k
from arborlm.runtime.platforms.cpu.quant_embedding import QuantEmbedding
from arborlm.runtime.platforms.cpu.quant_linear import QuantLinear
from arborlm.runtime.platforms.cpu.quant_loading import part_type
from arborlm.runtime.platforms.cpu.quant_stack import QuantLinearStack
from tests.runtime.gguf_reference import T, reference_dequantize
from tests.runtime.test_cpu_quant_linear import _skip_unless

QUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}
GGML_REF = {T.Q4_K: ("quantize_row_q4_K_ref", 144), T.Q6_K: ("quantize_row_q6_K_ref", 210)}


def _awkward_rows(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(12, 512, generator=gen) * 0.05  # [12, 512]: two super-blocks a row
    w[1] = 0.0
    w[2] = 0.3  # constant
    w[3] = -torch.rand(512, generator=gen)  # negative only
    w[4, 7] = 40.0  # an outlier
    w[5] = torch.rand(512, generator=gen) + 1  # positive only, away from zero
    w[6, :32] *= 1e-5  # a sub-block far below its neighbours
    return w


def _bound(qtype: T, x: np.ndarray) -> np.ndarray:
    """Per value: the error bound of the module docstring, `[rows, cols]`."""
    if qtype == T.Q4_K:
        sub = x.reshape(x.shape[0], -1, 8, 32)  # [rows, super, sub, 32]
        low = np.minimum(sub.min(-1), 0)
        step = (sub.max(-1) - low) / 15  # [rows, super, sub]
        d = step.max(-1, keepdims=True) / 63 * 1.01  # f16 rounding of the scale fields
        dmin = (-low).max(-1, keepdims=True) / 63 * 1.01
        bound = step + 8 * d + dmin
    else:
        sub = x.reshape(x.shape[0], -1, 16, 16)
        amax = np.abs(sub).max(-1)
        bound = amax / 31 + np.abs(sub).max((-1, -2))[..., None] / 128
    return np.repeat(bound[..., None], sub.shape[-1], -1).reshape(x.shape)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_round_trip_within_the_float64_bound(qtype):
    w = _awkward_rows(seed=int(qtype))
    blocks = QUANTIZERS[qtype](w)
    assert blocks.dtype == torch.uint8 and blocks.shape == (12, 2 * GGML_REF[qtype][1])
    values, _ = reference_dequantize(blocks.numpy(), qtype)
    x = w.double().numpy()
    error = np.abs(values - x)
    assert (error <= _bound(qtype, x)).all(), np.argwhere(error > _bound(qtype, x))[:5]
    assert error[1].max() == 0 and error[2].max() <= 0.3 * 2.0 ** -10  # zeros; a constant
    assert np.array_equal(dequantize(blocks.numpy(), qtype), values.astype(np.float32))


def _ggml_quantizer(qtype: T):
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python (its ggml library) is not installed")
    name, size = GGML_REF[qtype]
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))

    def quantize(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros((x.shape[0], x.shape[1] // 256 * size), np.uint8)
        getattr(lib, name)(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                           ctypes.c_int64(x.size))
        return out
    return quantize


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_as_good_as_llama_cpps_reference_quantizer(qtype):
    ggml = _ggml_quantizer(qtype)
    gen = torch.Generator().manual_seed(7)
    w = torch.cat([torch.randn(48, 1024, generator=gen) * 0.02,
                   _awkward_rows(3).repeat(1, 2)])  # [60, 1024]
    ours, theirs = QUANTIZERS[qtype](w).numpy(), ggml(w.numpy())
    x = w.double().numpy()
    err_ours = ((reference_dequantize(ours, qtype)[0] - x) ** 2).sum()
    err_theirs = ((reference_dequantize(theirs, qtype)[0] - x) ** 2).sum()
    assert err_ours <= 1.01 * err_theirs, (err_ours, err_theirs)
    assert (ours == theirs).mean() >= 0.98, (ours == theirs).mean()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_the_packed_kernel_reads_these_blocks(qtype, monkeypatch):
    _skip_unless("portable")
    monkeypatch.setenv("ARBORLM_QUANT_PATH", "portable")
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(70, 768, generator=gen) * 0.03
    layer = QuantLinear(QUANTIZERS[qtype](w), qtype, 768)
    values, magnitude = reference_dequantize(layer.blocks.numpy(), qtype)
    x = torch.randn(5, 768, generator=gen)
    want = x.double().numpy() @ values.T
    bound = 768 * 2.0 ** -23 * (np.abs(x.double().numpy()) @ magnitude.T) + 1e-6
    assert (np.abs(layer(x).double().numpy() - want) <= bound).all()


def test_q4_k_gives_llama_cpps_q4_k_m_mix_and_follows_its_dequantized_self(monkeypatch):
    _skip_unless("portable")
    monkeypatch.setenv("ARBORLM_QUANT_PATH", "portable")
    from tests.runtime.test_cpu_quant_loading import _log_probs, _tokens

    path = tiny_model("llama", hidden_size=256, intermediate_size=512, num_heads=4,
                      num_kv_heads=2)
    config = ModelConfig.from_path(path, "float32")
    quantized, ref = load_model(config, quantization="q4_k"), load_model(config)
    n = config.num_layers
    for i, layer in enumerate(quantized.model.layers):
        more = part_type("q4_k", "v_proj", i, n, 256) == T.Q6_K
        qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
        if more:  # q/k in Q4_K, v in Q6_K: a stack of the two
            assert isinstance(qkv, QuantLinearStack)
            assert [p.qtype for p in qkv.parts] == [T.Q4_K, T.Q6_K]
        else:
            assert isinstance(qkv, QuantLinear) and qkv.qtype == T.Q4_K
        assert down.qtype == (T.Q6_K if more else T.Q4_K)
        assert layer.mlp.gate_up_proj.qtype == layer.self_attn.o_proj.qtype == T.Q4_K
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                     "mlp.down_proj"):
            ref.model.layers[i].get_submodule(name).weight.copy_(
                layer.get_submodule(name).dequantized())
    assert any(part_type("q4_k", "down_proj", i, n, 256) == T.Q6_K for i in range(n))
    embedding = quantized.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding) and embedding.qtype == T.Q6_K
    head = quantized.lm_head
    assert isinstance(head, QuantLinear) and head.qtype == T.Q6_K
    if config.tie_word_embeddings:
        assert head.blocks is embedding.blocks  # one table
    else:
        ref.lm_head.weight.copy_(head.dequantized())
    ref.model.embed_tokens.weight.copy_(embedding.dequantized())
    prompt, more_ids = _tokens(30, seed=4), _tokens(6, seed=5)
    got = _log_probs(quantized, config, prompt, more_ids)
    want = _log_probs(ref, config, prompt, more_ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # portable: blocks decoded


def test_k_quant_types_fall_back_where_rows_are_not_whole_super_blocks():
    assert part_type("q4_k", "q_proj", 0, 30, 576) == T.Q5_0
    assert part_type("q4_k", "v_proj", 0, 30, 576) == T.Q8_0  # Q6_K's fallback
    assert part_type("q4_k", "down_proj", 0, 30, 1536) == T.Q6_K
    assert part_type("q4_k", "down_proj", 3, 30, 1536) == T.Q4_K
    assert part_type("q6_k", "o_proj", 3, 30, 512) == T.Q6_K


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_searching_in_chunks_gives_the_same_blocks(qtype, monkeypatch):
    """The scale searches run `kquants.CHUNK` sub-blocks at a time; each sub-block's is its own,
    so any chunk size (here 7, splitting super-blocks) writes the same bytes."""
    from arborlm.runtime.platforms.cpu import kquants

    quantize = kquants.quantize_q4_k if qtype == T.Q4_K else kquants.quantize_q6_k
    weight = _awkward_rows(seed=3)
    whole = quantize(weight)
    monkeypatch.setattr(kquants, "CHUNK", 7)
    assert torch.equal(quantize(weight), whole)

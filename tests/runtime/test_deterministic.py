"""Deterministic inference (`enable_deterministic_inference`; on by default in bfloat16).

A token's logits must depend only on its own tokens: not on the batch, chunk boundaries, the
page size, prefix-cache hits, continuous decode steps or the engine's process layout. The
matrix runs on tiny models of three architectures (Llama: the fused decode step; Qwen2: q/k/v
biases; Qwen3: q/k norms, eager decode) in float32 and bfloat16, comparing greedy tokens and
their logprobs, the top 5 and 64 token ids spread over the vocabulary at every step, bit for
bit (logprobs are the logits less one log-sum-exp); `tests/real_model/test_determinism.py`
runs it on the real model.
The kernels it rests on are checked here too: every token of an extend attending as a decode
query would, the bfloat16 row functions, and the panel linears at every batch size.
"""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.errors import InvalidRequestError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from tests.runtime.engine_helpers import exactness_matrix

DTYPES = [torch.float32, torch.bfloat16]


def _kernels(dtype: torch.dtype) -> None:
    if not cpu_kernels.available(dtype):
        pytest.skip(f"ArborLM's CPU kernels do not run here for {dtype}")


# Short and long prompts together: a batch of very different lengths, a prompt longer than a
# decode-sized batch (128 rows) and than the chunk sizes, and two that share a long prefix (the
# cascade attention that deterministic inference turns off).
_STORY = "Once upon a time, in a land far away, there lived a dragon who loved numbers. " * 10
PROMPTS = ["The quick brown fox", _STORY + "The dragon said", "A",
           "def add(a, b):\n    return", _STORY + "Then the king", "1 2 3 4 5 6 7 8 9"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_exactness_matrix(make_tiny_model, arch: str, dtype: str) -> None:
    _kernels(getattr(torch, dtype))
    path = make_tiny_model(arch)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    # Beyond the top 5: 64 token ids spread over the vocabulary at every step.
    report = exactness_matrix(str(path), PROMPTS, vocab=vocab, dtype=dtype,
                              enable_deterministic_inference=True)
    assert report == {name: [] for name in report}, report


@pytest.mark.parametrize("quantization", ["q8_0", "q4_k"])
def test_exactness_matrix_with_packed_weights(make_tiny_model, quantization: str) -> None:
    """`--quantization`: `quant_linear` picks its path by the number of rows (two-term int8
    activations below 8, float from 8), so a row's result would depend on its batch;
    deterministic inference pins one path for every call."""
    _kernels(torch.bfloat16)
    if not cpu_kernels.quant_linear_available():
        pytest.skip("the packed-weight kernel does not run here")
    path = make_tiny_model("llama")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    report = exactness_matrix(str(path), PROMPTS, vocab=vocab, dtype="bfloat16",
                              quantization=quantization, enable_deterministic_inference=True)
    assert report == {name: [] for name in report}, report


@pytest.mark.parametrize("dtype,options,expected", [
    ("bfloat16", {}, True),  # the default dtype on CPUs with AVX512-BF16
    ("bfloat16", {"enable_deterministic_inference": False}, False),
    ("float32", {}, False),  # its cost in float32 is above the 10% bar (docs/determinism.md)
    ("float32", {"enable_deterministic_inference": True}, True),
])
def test_default_is_on_in_bfloat16_and_off_in_float32(make_tiny_model, dtype, options,
                                                        expected) -> None:
    from arborlm import Engine

    _kernels(getattr(torch, dtype))
    engine = Engine(str(make_tiny_model("llama")), dtype=dtype, **options)
    try:
        assert engine.get_server_info()["deterministic_inference"] is expected
    finally:
        engine.shutdown()


def test_seeded_sampling_is_reproducible_beside_other_requests(make_tiny_model) -> None:
    from arborlm import Engine

    _kernels(torch.float32)
    engine = Engine(str(make_tiny_model("llama")), dtype="float32",
                    enable_deterministic_inference=True)
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 16, "sampling_seed": 7,
              "ignore_eos": True}
    try:
        alone = engine.generate(PROMPTS[1], params)["output_ids"]
        engine.flush_cache()
        beside = engine.generate(PROMPTS, params)[1]["output_ids"]
    finally:
        engine.shutdown()
    assert alone == beside


def test_asking_where_it_cannot_hold_names_why(make_tiny_model) -> None:
    path = str(make_tiny_model("llama"))
    with pytest.raises(InvalidRequestError, match="enable_torch_compile") as e:
        EngineArgs(model_path=path, enable_deterministic_inference=True,
                   enable_torch_compile=True).resolve()
    assert e.value.param == "enable_deterministic_inference"
    with pytest.raises(InvalidRequestError, match="CPU only"):
        EngineArgs(model_path=path, device="cuda",
                   enable_deterministic_inference=True).resolve()
    # Not asked for: off where it cannot hold, without an error.
    assert not EngineArgs(model_path=path, enable_torch_compile=True).resolve().deterministic
    assert not EngineArgs(model_path=path, device="cuda").resolve().deterministic
    assert not EngineArgs(model_path=path, dtype="float16").resolve().deterministic


def test_with_packed_weights_it_is_opt_in(make_tiny_model) -> None:
    """`--quantization`: pinning every packed linear to one path costs one-row decode its
    integer path (docs/determinism.md), so it is off unless asked for, and holds when asked."""
    _kernels(torch.bfloat16)
    if not cpu_kernels.quant_linear_available():
        pytest.skip("quant_linear did not build")
    path = str(make_tiny_model("llama"))
    assert EngineArgs(model_path=path, dtype="bfloat16").resolve().deterministic
    assert not EngineArgs(model_path=path, dtype="bfloat16",
                          quantization="q8_0").resolve().deterministic
    assert EngineArgs(model_path=path, dtype="bfloat16", quantization="q8_0",
                      enable_deterministic_inference=True).resolve().deterministic


def test_on_a_cpu_without_avx512_it_is_off_and_refused_naming_why(make_tiny_model,
                                                                  monkeypatch) -> None:
    """An AVX2-only CPU (AMD Zen 2/3): the kernels' instructions missing, as
    `capabilities.kernel_instructions` reports there."""
    import arborlm.runtime.config as config

    monkeypatch.setattr(config, "kernel_instructions", lambda dtype: False)
    path = str(make_tiny_model("llama"))
    for dtype in ("float32", "bfloat16"):
        assert not EngineArgs(model_path=path, dtype=dtype).resolve().deterministic
        with pytest.raises(InvalidRequestError, match="lacks the instructions of ArborLM's") as e:
            EngineArgs(model_path=path, dtype=dtype,
                       enable_deterministic_inference=True).resolve()
        assert e.value.param == "enable_deterministic_inference" and "AVX-512" in str(e.value)


def test_without_the_kernels_it_is_off_by_default_and_refused_when_asked(make_tiny_model,
                                                                         monkeypatch) -> None:
    from arborlm import Engine
    from arborlm.errors import ModelLoadError

    _kernels(torch.bfloat16)
    monkeypatch.setenv("ARBORLM_CPU_KERNELS", "0")  # the kernels turned off, as if not built
    path = str(make_tiny_model("llama"))
    engine = Engine(path, dtype="bfloat16")
    try:
        assert engine.get_server_info()["deterministic_inference"] is False
    finally:
        engine.shutdown()
    with pytest.raises(ModelLoadError, match="kernels for torch.bfloat16 are not available"):
        Engine(path, dtype="bfloat16", enable_deterministic_inference=True)


def test_cli_flag_is_on_off_or_default() -> None:
    from arborlm.server.cli import parse_args

    def parsed(*flags: str) -> bool | None:
        return parse_args(list(flags))[1].enable_deterministic_inference

    assert parsed() is None
    assert parsed("--enable-deterministic-inference") is True
    assert parsed("--no-enable-deterministic-inference") is False


# --- the kernels ---------------------------------------------------------------------------------


def _pool(dtype: torch.dtype, slots: int, kv_heads: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    return k, v


@pytest.mark.parametrize("dtype", DTYPES)
# Head dim 48 has no run-of-tokens specialization: each token then goes through the decode row.
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (9, 3, 64), (8, 8, 128), (6, 1, 32),
                                                (4, 2, 48)])
def test_extend_tokens_attend_as_decode_queries(dtype, heads, kv_heads, dim) -> None:
    """`paged_attention_rows` gives each token exactly what `decode_attention_paged` gives the
    same query with the same keys, alone, whatever else is in the call."""
    _kernels(torch.float32)
    k_pool, v_pool = _pool(dtype, 400, kv_heads, dim, seed=1)
    table = torch.zeros(5, 300, dtype=torch.int64)
    table[1, :200] = torch.randperm(399)[:200] + 1  # request A: scattered slots
    table[3, :90] = torch.arange(300, 390)  # request B
    # Tokens of A at positions 150..199 (a chunk on a cached prefix) and all of B's 90.
    rows = torch.tensor([1] * 50 + [3] * 90)
    lens = torch.cat([torch.arange(151, 201), torch.arange(1, 91)])
    q = torch.randn(140, heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    scale = dim ** -0.5
    got = cpu_kernels.paged_attention_rows(q, k_pool, v_pool, table, rows, lens, scale)
    for t in (0, 17, 49, 50, 51, 139):
        want = cpu_kernels.decode_attention_paged(q[t:t + 1], k_pool, v_pool,
                                                  table[rows[t]].unsqueeze(0), lens[t:t + 1],
                                                  scale)
        assert torch.equal(got[t], want[0]), t
    # And the float64 reference (softmax over each token's keys).
    for t in (0, 49, 139):
        keys = table[rows[t], :lens[t]]
        kk = k_pool[keys].double().repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        vv = v_pool[keys].double().repeat_interleave(heads // kv_heads, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[t].double(), kk) * scale, dim=-1)
        ref = torch.einsum("hl,lhd->hd", w, vv)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got[t].double(), ref, atol=tol, rtol=tol)


def test_extend_rows_are_checked() -> None:
    _kernels(torch.float32)
    k_pool, v_pool = _pool(torch.float32, 8, 1, 16, seed=0)
    table = torch.zeros(2, 4, dtype=torch.int64)
    q = torch.randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="row 2 is outside"):
        cpu_kernels.paged_attention_rows(q, k_pool, v_pool, table, torch.tensor([2]),
                                         torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="length of 5"):
        cpu_kernels.paged_attention_rows(q, k_pool, v_pool, table, torch.tensor([1]),
                                         torch.tensor([5]), 1.0)
    table[1, 0] = 99
    with pytest.raises(RuntimeError, match="slot 99"):
        cpu_kernels.paged_attention_rows(q, k_pool, v_pool, table, torch.tensor([1]),
                                         torch.tensor([1]), 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [576, 100, 7])  # lanes only, lanes and a tail, a tail only
def test_row_functions_match_a_float64_reference_and_ignore_the_batch(dtype, size) -> None:
    """bfloat16 and float32 RMSNorm (with the residual add) and SwiGLU: each rounding where
    the reference model rounds, and a row's result the same alone or among 300 rows."""
    _kernels(torch.float32)
    g = torch.Generator().manual_seed(size)
    x = (torch.randn(300, size, generator=g) * 3).to(dtype)
    res = torch.randn(300, size, generator=g).to(dtype)
    w = (torch.rand(size, generator=g) + 0.5).to(dtype)
    summed = res.clone()
    out = cpu_kernels.add_rms_norm(x, summed, w, 1e-6)
    want_sum = (x.double() + res.double()).to(dtype)
    assert torch.equal(summed, want_sum)
    s = want_sum.double()
    normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    ref = (w.double() * normed.double()).to(dtype)
    ulp = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.double(), ref.double(), atol=ulp, rtol=ulp)
    one = res[123:124].clone()
    assert torch.equal(cpu_kernels.add_rms_norm(x[123:124], one, w, 1e-6), out[123:124])

    gate_up = torch.randn(300, 2 * size, generator=g).to(dtype) * 4
    act = cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up[:, :size].double(), gate_up[:, size:].double()
    silu = (gate / (1 + torch.exp(-gate))).to(dtype).double()
    torch.testing.assert_close(act.double(), (silu * up).to(dtype).double(), atol=ulp,
                               rtol=ulp)
    assert torch.equal(cpu_kernels.silu_and_mul(gate_up[7:8]), act[7:8])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 64), (576, 1536), (96, 40)])
def test_panel_linears_give_every_row_the_same_result_at_any_batch_size(dtype, shape) -> None:
    from torch import nn

    from arborlm.runtime.platforms.cpu.linear import PackedLinear, pack_linears

    _kernels(dtype)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(shape[0], shape[1], bias=True).to(dtype))
    assert pack_linears(model, panels_only=True) == 1  # however small
    layer = model[0]
    assert isinstance(layer, PackedLinear) and layer.packed is None
    x = torch.randn(600, shape[0]).to(dtype)
    full = layer(x)
    for rows in (1, 2, 13, 128, 129, 300):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
    assert torch.equal(layer(x[599:600]), full[599:600])

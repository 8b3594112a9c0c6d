"""The fused decode step (`arborlm::decode_step`) on weights kept in GGUF's packed blocks
(`--quantization`), on every CPU it runs on: with AVX-512 in float32 and bfloat16, and on a CPU
with AVX2 but not AVX-512 in float32, where its attention and per-row steps take AVX2 forms
(`decode_attention.cpp`'s `attend_row_avx2`, `row_ops.h`'s `avx2`). Tokens equal the eager
engine's, logprobs to the rounding of the glue's sums. The fused step's other tests, which need
ArborLM's AVX-512 kernels, are in `test_fused_decode.py`.
"""

from __future__ import annotations

import pytest
import torch

from arborlm import Engine
from arborlm.runtime.platforms.cpu import capabilities, fused_decode
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from tests.runtime.engine_helpers import GREEDY
from tests.runtime.test_fused_decode import (
    NEW,
    PROMPT,
    _count_fused_steps,
    _decode_together,
    _logprobs,
)

# Packed GGUF weights (`--quantization`): Q4_0 quantized at load (QuantLinears, a Q8_0
# embedding and head); llama.cpp's Q4_K_M mix at load (stacks of Q4_K and Q6_K parts, a Q6_K
# embedding); a Qwen2 GGUF file whose layer-0 attn_v is Q8_0 beside the others' Q4_0 (a stack
# with a bias, QuantLinears with theirs).
PACKED = [("q4_0", "llama", None), ("q4_k", "llama", None), ("gguf", "qwen2", "Q4_0")]


@pytest.mark.parametrize("deterministic", [False, True, "amx"], ids=["by-rows", "pinned", "amx"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization,arch,file_type", PACKED,
                         ids=["q4_0", "q4_k", "gguf-qwen2-Q4_0"])
def test_packed_weights_decode_through_the_fused_step(quantization, arch, file_type, dtype,
                                                      deterministic, monkeypatch, tmp_path):
    """The fused step takes packed weights as they are (the embedding decoded per looked-up
    row, every linear through the eager modules' kernel and path): tokens equal the eager
    engine's, logprobs to the rounding of the glue's sums, at batch sizes 3, 2 and 1, with the
    path chosen by rows or pinned by deterministic inference, or (where the CPU has AMX) "amx"
    from 2 rows; `run_ahead` (continuous greedy steps) too. On a CPU with AVX2 but not AVX-512
    the step runs there too, in float32, with AVX2 attention and row steps against the eager
    engine's torch ops."""
    from gguf import GGMLQuantizationType as T

    from arborlm.runtime.models.factory import tiny_model
    from tests.runtime.gguf_writer import write_gguf
    from tests.runtime.test_gguf_models import SIZE

    if not cpu_kernels.quant_linear_available():
        pytest.skip("quant_linear did not build")
    if not cpu_kernels.packed_step_available(getattr(torch, dtype)):
        pytest.skip(f"the fused step does not run in {dtype} on this CPU")
    if deterministic and dtype == "float32":
        pytest.skip("deterministic inference pins the path in both dtypes, and \"amx\" takes "
                    "bfloat16 only: bfloat16 suffices")
    paths: list[str] = []
    amx = deterministic == "amx"
    if amx:
        if "amx" not in cpu_kernels.quant_paths():
            pytest.skip("this CPU lacks AMX-BF16")
        monkeypatch.setattr(cpu_kernels, "FLOAT_PATH_ROWS", 2)  # vnni2 for one row only
        monkeypatch.setattr(cpu_kernels, "AMX_ROWS", 2)
        monkeypatch.setattr(fused_decode.FusedDecodeStep, "quant_path",
                            _recording(fused_decode.FusedDecodeStep.quant_path, paths))
        deterministic = False
    path = tiny_model(arch, **SIZE)
    if file_type is not None:
        path = write_gguf(path, tmp_path / f"{arch}.gguf", T[file_type],
                          zero_typed={"blk.0.attn_v.weight": T.Q8_0})
    options = dict(dtype=dtype, quantization=quantization, max_total_tokens=2048,
                   enable_deterministic_inference=deterministic)
    calls = _count_fused_steps(monkeypatch)
    with Engine(str(path), **options) as engine:
        assert isinstance(engine.scheduler.runner.decode, fused_decode.FusedDecodeStep)
        fused = _decode_together(engine)
    assert "amx" in paths if amx else "amx" not in paths
    assert sum(calls) == sum(n - 1 for n in NEW) and set(calls) == {1, 2, 3}
    ahead_calls = []
    run_ahead = fused_decode.FusedDecodeStep.run_ahead
    monkeypatch.setattr(fused_decode.FusedDecodeStep, "run_ahead",
                        lambda self, batch, slots: ahead_calls.append(len(slots))
                        or run_ahead(self, batch, slots))
    with Engine(str(path), **options, num_continuous_decode_steps=4) as engine:
        alone = engine.generate(input_ids=PROMPT, sampling_params=dict(GREEDY, max_new_tokens=12))
    assert 4 in ahead_calls  # greedy without logprobs: steps run ahead
    monkeypatch.setattr(fused_decode, "create_fused_decode", lambda parts: None)
    with Engine(str(path), **options) as engine:
        assert not isinstance(engine.scheduler.runner.decode, fused_decode.FusedDecodeStep)
        eager = _decode_together(engine)
        eager_alone = engine.generate(input_ids=PROMPT,
                                      sampling_params=dict(GREEDY, max_new_tokens=12))
    assert alone["output_ids"] == eager_alone["output_ids"]
    # The glue's sums run in their own orders (as in `_check_equal`); in float32 an ulp there
    # can move one of vnni2's activation quants a step (measured: up to 3e-4).
    tol = 1e-3 if dtype == "float32" else 2e-2
    for f, e in zip(fused, eager):
        assert f["output_ids"] == e["output_ids"]
        assert _logprobs(f) == pytest.approx(_logprobs(e), abs=tol)


def _recording(quant_path, paths: list[str]):
    """`FusedDecodeStep.quant_path` that also notes each path it gives."""
    def recorded(self, rows: int) -> str:
        paths.append(quant_path(self, rows))
        return paths[-1]
    return recorded


def _attention_reference(q, pool_k, pool_v, slots, lens, scale):
    """float64 softmax attention of q [B, H, D] over pool rows slots[b, :lens[b]] (grouped KV
    heads); zero for a row of no keys."""
    batch, heads, dim = q.shape
    group = heads // pool_k.shape[1]
    out = torch.zeros(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        rows = slots[b, :lens[b]]
        for h in range(heads if lens[b] else 0):
            k = pool_k[rows, h // group].double()
            v = pool_v[rows, h // group].double()
            out[b, h] = torch.softmax((k @ q[b, h].double()) * scale, 0) @ v
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (9, 3, 64), (2, 2, 32)])
def test_paged_decode_attention_matches_float64(heads, kv_heads, dim):
    """The paged decode attention the fused step calls, on whichever form this CPU runs (an
    AVX2 CPU: `attend_row_avx2`), against float64: a row
    of no keys (zero output), a long row, slots out of order, tokens on mapped slot rows."""
    if not (cpu_kernels.attention_available(torch.float32)
            or cpu_kernels.packed_step_available(torch.float32)):
        pytest.skip("neither ArborLM's AVX-512 kernels nor its AVX2 step run here")
    g = torch.Generator().manual_seed(heads * dim)
    pool_k = torch.randn(600, kv_heads, dim, generator=g)
    pool_v = torch.randn(600, kv_heads, dim, generator=g)
    lens = torch.tensor([5, 0, 517, 1])
    slots = torch.stack([torch.randperm(600, generator=g)[:520] for _ in range(4)])
    q = torch.randn(4, heads, dim, generator=g) * 2
    want = _attention_reference(q, pool_k, pool_v, slots, lens, dim ** -0.5)
    got = torch.ops.arborlm.decode_attention_paged(q, pool_k, pool_v, slots, lens, dim ** -0.5)
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)
    assert torch.all(got[1] == 0)
    # Tokens whose slot rows are mapped (`paged_attention_rows`): row 2's table for two of them.
    rows = torch.tensor([2, 0, 2, 3])
    mapped = torch.ops.arborlm.paged_attention_rows(q, pool_k, pool_v, slots, rows,
                                                    torch.tensor([517, 5, 300, 1]), dim ** -0.5)
    want = _attention_reference(q, pool_k, pool_v, slots[rows], torch.tensor([517, 5, 300, 1]),
                                dim ** -0.5)
    assert torch.allclose(mapped.double(), want, atol=2e-5, rtol=1e-4)


def test_without_avx512_float_models_do_not_take_the_step(make_tiny_model):
    """On a CPU with AVX2 but not AVX-512 the step takes packed linears only (its float
    linears need AVX-512 panels): an unquantized float32 engine decodes eagerly there, and a
    quantized bfloat16 one too."""
    if cpu_kernels.available(torch.float32) or not capabilities.has_avx2_fma():
        pytest.skip("for CPUs with AVX2 but not AVX-512")
    path = str(make_tiny_model("llama"))
    with Engine(path, dtype="float32", max_total_tokens=1024) as engine:
        assert not isinstance(engine.scheduler.runner.decode, fused_decode.FusedDecodeStep)
    with Engine(path, dtype="bfloat16", quantization="q4_0", max_total_tokens=1024) as engine:
        assert not isinstance(engine.scheduler.runner.decode, fused_decode.FusedDecodeStep)
        out = engine.generate(input_ids=PROMPT, sampling_params=dict(GREEDY, max_new_tokens=4))
    assert len(out["output_ids"]) == 4

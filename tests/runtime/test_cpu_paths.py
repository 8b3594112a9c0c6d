"""The CPU speed paths keep greedy decoding equal to transformers, token for token (float32).

Cascade decode and extend (groups of a batch that share a cached prefix read it once each), the
decode workspace, batch-1 decode, prompts prefilled without reading the pool and oneDNN-
prepacked linears are all checked end to end; plus the `dtype=auto` rule (bfloat16 on CPUs with
native bfloat16) on fake `/proc/cpuinfo` files.
"""

from __future__ import annotations

import pytest
import torch

from arborlm import Engine
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.platforms.cpu import attention as cpu_attention
from arborlm.runtime.platforms.cpu import linear as cpu_linear
from arborlm.runtime.platforms.cpu.capabilities import has_native_bf16
from tests.runtime.engine_helpers import GREEDY, hf_greedy


def test_cascade_decode_matches_transformers(make_tiny_model, monkeypatch):
    """Two groups of prompts on two cached prefixes, plus one prompt on neither: the decode
    steps run through the cascade path with two groups, and greedy outputs equal transformers'."""
    path = str(make_tiny_model("llama"))
    groups = []
    cascade = cpu_attention.CpuAttentionBackend._with_prefix

    def counting(*args):
        groups.append(args[5].num_groups)
        return cascade(*args)

    monkeypatch.setattr(cpu_attention.CpuAttentionBackend, "_with_prefix", staticmethod(counting))
    shared = [[(7 * i) % 400 + 10 for i in range(90)],
              [(11 * i) % 300 + 20 for i in range(120)]]  # > CASCADE_MIN_PREFIX tokens
    prompts = [shared[j % 2] + [20 + j, 30 + j, 40 + 2 * j] for j in range(6)]
    prompts.append([(5 * i) % 200 + 8 for i in range(50)])
    # the modules' own decode path (the fused step's cascade is tested in test_fused_decode)
    engine = Engine(path, dtype="float32", debug_integrity=True, disable_fused_decode=True)
    engine.generate(input_ids=[s + [5] for s in shared],
                    sampling_params={"max_new_tokens": 1})  # cache both prefixes
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert 2 in groups, "the batch never took the cascade path with both groups"
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(path, prompt, GREEDY["max_new_tokens"])
    engine.check_integrity()
    engine.shutdown()


def test_cascade_extend_matches_transformers(make_tiny_model, monkeypatch):
    """Prompts on one long shared prefix, sent together: the first is prefilled, the others
    extend on its cached prefix as one cascade group; greedy outputs equal transformers'."""
    path = str(make_tiny_model("llama"))
    sizes = []
    extend_group = cpu_attention.attend_extend_group

    def counting(*args):
        sizes.append(len(args[4].members))
        return extend_group(*args)

    monkeypatch.setattr(cpu_attention, "attend_extend_group", counting)
    shared = [(7 * i) % 400 + 10 for i in range(100)]  # > CASCADE_MIN_PREFIX tokens
    prompts = [shared + [20 + j, 30 + j, 40 + 2 * j][: 1 + j % 3] for j in range(5)]
    engine = Engine(path, dtype="float32", debug_integrity=True)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert 4 in sizes, f"no extend of the 4 later prompts as one group: {sizes}"
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(path, prompt, GREEDY["max_new_tokens"])
    engine.check_integrity()
    engine.shutdown()


def test_batch_of_one_matches_transformers(make_tiny_model):
    path = str(make_tiny_model("qwen3"))
    prompt = [(11 * i) % 300 + 6 for i in range(40)]
    engine = Engine(path, dtype="float32")
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == hf_greedy(path, prompt, GREEDY["max_new_tokens"])
    engine.shutdown()


def test_auto_dtype_follows_the_cpu(make_tiny_model, tmp_path, monkeypatch):
    with_bf16 = tmp_path / "bf16"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    without = tmp_path / "plain"
    without.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert has_native_bf16(str(with_bf16))
    assert not has_native_bf16(str(without))
    assert not has_native_bf16(str(tmp_path / "missing"))

    path = str(make_tiny_model("llama"))  # a float32 checkpoint
    monkeypatch.setattr("arborlm.runtime.config.has_native_bf16", lambda: True)
    assert EngineArgs(model_path=path).resolve().model.dtype == torch.bfloat16
    assert EngineArgs(model_path=path, dtype="float32").resolve().model.dtype == torch.float32
    monkeypatch.setattr("arborlm.runtime.config.has_native_bf16", lambda: False)
    assert EngineArgs(model_path=path).resolve().model.dtype == torch.float32


def test_packed_linears_match_transformers(make_tiny_model, monkeypatch):
    """oneDNN-prepacked weights (normally only above MIN_PACKED_ELEMENTS) keep greedy equality."""
    monkeypatch.setattr(cpu_linear, "MIN_PACKED_ELEMENTS", 0)
    path = str(make_tiny_model("qwen2"))  # q/k/v biases go through the packed op too
    engine = Engine(path, dtype="float32")
    packed = [m for m in engine.scheduler.runner.model.modules()
              if isinstance(m, cpu_linear.PackedLinear)]
    assert len(packed) == 4 * 2 + 1  # qkv, o, gate_up, down in each of 2 layers; lm_head
    prompts = [[(13 * i + j) % 400 + 6 for i in range(12 + 5 * j)] for j in range(3)]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(path, prompt, GREEDY["max_new_tokens"])
    engine.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_linear_matches_f_linear(dtype):
    if not cpu_linear.packing_available(dtype):
        pytest.skip("no oneDNN packed linear for this dtype here (the torch build or the CPU)")
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(256, 384, bias=True).to(dtype)
    packed = cpu_linear.PackedLinear(linear)
    threads = torch.get_num_threads()
    try:
        for n_threads, rows in [(1, 1), (2, 1), (2, 5), (2, 64), (2, 200)]:  # every path
            torch.set_num_threads(n_threads)
            x = torch.randn(rows, 256, generator=gen).to(dtype)
            expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
            if packed.panels is not None and rows <= packed.panel_rows:
                # ArborLM's kernel, other summation orders: checked in test_cpu_kernels.py
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(packed(x), expected, atol=tol, rtol=tol)
            elif dtype == torch.bfloat16:  # the same oneDNN kernels as F.linear: bit-identical
                assert torch.equal(packed(x), expected)
            else:
                torch.testing.assert_close(packed(x), expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_decode_workspace_matches_transformers(make_tiny_model, monkeypatch):
    """Consecutive decode steps append to the workspace; joins and finishes refill it."""
    path = str(make_tiny_model("llama"))
    modes: list[str] = []
    metadata = cpu_attention.CpuAttentionBackend._decode_metadata

    def recording(self, batch):
        meta = metadata(self, batch)
        modes.append(meta.workspace)
        return meta

    monkeypatch.setattr(cpu_attention.CpuAttentionBackend, "_decode_metadata", recording)
    prompts = [[(17 * i + j) % 400 + 6 for i in range(5 + 9 * j)] for j in range(3)]
    params = [dict(GREEDY, max_new_tokens=n) for n in (16, 9, 12)]  # finishes refill it
    engine = Engine(path, dtype="float32", disable_fused_decode=True)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert {"fill", "append"} <= set(modes)
    for prompt, p, out in zip(prompts, params, outs):
        assert out["output_ids"] == hf_greedy(path, prompt, p["max_new_tokens"])
    engine.shutdown()


def test_bfloat16_linears_are_packed_only_where_onednn_can_pack_them():
    """oneDNN packs bfloat16 weights only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT; on an
    AVX2-only CPU `pack_linears` leaves them plain (it used to raise there, so a bfloat16
    engine could not load) and the model computes as before."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.Linear(384, 512)).bfloat16()
    x = torch.randn(5, 512).bfloat16()
    with torch.no_grad():
        want = model(x)
        packed = cpu_linear.pack_linears(model)
        assert packed == (2 if cpu_linear.packing_available(torch.bfloat16) else 0)
        torch.testing.assert_close(model(x), want, atol=0.05, rtol=0.02)

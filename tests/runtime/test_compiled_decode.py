"""Compiled decode (`enable_torch_compile`) keeps greedy decoding equal to transformers.

One engine (its two graphs compile at start-up, ~10-20 s the first time, then from Inductor's
disk cache) with both kinds of traced linear: the larger weights oneDNN-packed (as the benchmark
models' are), the smaller ones (q/k/v with biases, o, down) `RowLinear`s; batches of 1 and 2
decode compiled (each graph's code called directly, without Dynamo's guards), a batch of 3 and
a sequence past `COMPILED_MAX_SEQ_LEN` eagerly, and no step may recompile; then the same
through Dynamo when no generated code was caught. The engine runs twice: with attention on
ArborLM's CPU kernel (`decode_attention_paged` in the graph) and with the traced gather-and-sum
attention that serves where the kernel cannot. `row_linear`'s arithmetic is checked against
`F.linear` directly.
"""

from __future__ import annotations

import pytest
import torch

from arborlm import Engine
from arborlm.errors import InvalidRequestError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.platforms.cpu import cascade, compiled_decode, fused_decode
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu import linear as cpu_linear
from tests.runtime.engine_helpers import GREEDY, hf_greedy


@pytest.mark.parametrize("attention", ["kernel", "traced"])
def test_compiled_decode_matches_transformers(make_tiny_model, monkeypatch, attention):
    if not cpu_linear.packing_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    if attention == "kernel" and not cpu_kernels.attention_available(torch.float32):
        pytest.skip("ArborLM's CPU kernels do not run on this machine")
    if attention == "traced":
        monkeypatch.setattr(cpu_kernels, "attention_available", lambda dtype: False)
    monkeypatch.setattr(cpu_linear, "MIN_PACKED_ELEMENTS", 10_000)  # gate_up and lm_head
    path = str(make_tiny_model("qwen2"))
    # One decode step per call: the test counts the steps that go through `forward`.
    # The fused C++ step off: it would take these steps instead of the graph (test_fused_decode).
    engine = Engine(path, dtype="float32", enable_torch_compile=True, torch_compile_max_bs=2,
                    num_continuous_decode_steps=1, debug_integrity=True,
                    disable_fused_decode=True)
    kinds = [type(m) for m in engine.scheduler.runner.model.modules()]
    assert kinds.count(cpu_linear.PackedLinear) == 2 * 1 + 1
    assert kinds.count(cpu_linear.RowLinear) == 2 * 3
    compiled = engine.scheduler.runner.decode
    assert isinstance(compiled, compiled_decode.CompiledDecodeRunner)
    assert compiled.attention.kernel == (attention == "kernel")
    assert set(compiled._direct) == {1, 2}  # both graphs are called without Dynamo's guards
    sizes: list[int] = []
    run = compiled.run

    def recording(batch):
        sizes.append(batch.batch_size)
        return run(batch)

    monkeypatch.setattr(compiled, "run", recording)
    prompts = [[(13 * i + j) % 400 + 6 for i in range(7 + 11 * j)] for j in range(3)]
    params = [dict(GREEDY, max_new_tokens=n) for n in (16, 6, 11)]  # the batch shrinks 3, 2, 1
    with torch.compiler.set_stance("fail_on_recompile"):
        alone = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert alone["output_ids"] == hf_greedy(path, prompts[0], GREEDY["max_new_tokens"])
    for prompt, p, out in zip(prompts, params, outs):
        assert out["output_ids"] == hf_greedy(path, prompt, p["max_new_tokens"])
    assert {1, 2} <= set(sizes) and 3 not in sizes  # 3 requests exceed torch_compile_max_bs
    monkeypatch.setattr(compiled_decode, "COMPILED_MAX_SEQ_LEN", 20)
    steps = len(sizes)
    long = engine.generate(input_ids=prompts[2], sampling_params=GREEDY)  # 29 tokens
    # The kernel reads the pool in place: no length limit; the traced gather: eager past it.
    assert (len(sizes) > steps) == (attention == "kernel")
    assert long["output_ids"] == hf_greedy(path, prompts[2], GREEDY["max_new_tokens"])
    # Two requests on one cached prefix: the traced graph would read the prefix once per
    # request, so they decode eagerly (cascade reads it once); the fused step has cascade
    # attention of its own and takes them (test_fused_decode.py).
    monkeypatch.setattr(cascade, "CASCADE_MIN_PREFIX", 8)
    shared = prompts[1][:12]
    engine.generate(input_ids=shared, sampling_params=dict(GREEDY, max_new_tokens=1))
    steps = len(sizes)
    pair = [shared + [7, 8], shared + [9]]
    outs = engine.generate(input_ids=pair, sampling_params=GREEDY)
    assert 2 not in sizes[steps:]
    for prompt, out in zip(pair, outs):
        assert out["output_ids"] == hf_greedy(path, prompt, GREEDY["max_new_tokens"])
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_row_linear_matches_f_linear(dtype, bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(1, 256, generator=gen).to(dtype)
    got = cpu_linear.row_linear(x, weight, b)
    assert got.shape == (1, 96) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), atol=tol, rtol=tol)


def test_row_linear_module_shares_and_matches():
    linear = torch.nn.Linear(64, 48, bias=True)
    row = cpu_linear.RowLinear.of(linear)
    assert row.weight is linear.weight and row.bias is linear.bias
    x = torch.randn(3, 64)
    assert torch.equal(row(x), linear(x))  # eagerly the same F.linear


def test_untransposed_packed_linear_keeps_its_results(monkeypatch):
    """`transpose_fp32=False` (the compiled engine's layout where the panel kernel does not
    run) changes no eager result."""
    if not cpu_linear.packing_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    monkeypatch.setenv("ARBORLM_CPU_KERNELS", "0")  # the plain copy, as without the kernels
    linear = torch.nn.Linear(256, 384, bias=True)
    packed = cpu_linear.PackedLinear(linear, transpose_fp32=False)
    assert packed.panels is None and packed.plain.shape == (384, 256)
    for rows in (1, 5, 200):  # packed (the plain copy serves traced rows only)
        x = torch.randn(rows, 256)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_torch_compile_max_bs_is_validated(make_tiny_model):
    path = str(make_tiny_model("llama"))
    with pytest.raises(InvalidRequestError, match="torch_compile_max_bs"):
        EngineArgs(model_path=path, torch_compile_max_bs=0).resolve()


def test_steps_go_through_dynamo_when_no_code_was_caught(make_tiny_model, monkeypatch):
    """Without the generated code (no bytecode hook call), every step runs through the compiled
    callable and its guards, with the same greedy output."""

    class NoHook:
        def remove(self) -> None:
            pass

    monkeypatch.setattr(compiled_decode, "register_bytecode_hook", lambda hook: NoHook())
    # Batch 1 would otherwise take the fused C++ step (test_fused_decode.py), not a graph.
    monkeypatch.setattr(fused_decode.FusedDecodeStep, "of",
                        classmethod(lambda cls, parts, max_bs: None))
    path = str(make_tiny_model("llama"))
    engine = Engine(path, dtype="float32", enable_torch_compile=True)
    compiled = engine.scheduler.runner.decode
    assert compiled._direct == {}
    calls = []
    step = compiled.step
    monkeypatch.setattr(compiled, "step", lambda *a: calls.append(1) or step(*a))
    prompt = [(7 * i) % 300 + 6 for i in range(9)]
    with torch.compiler.set_stance("fail_on_recompile"):
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == hf_greedy(path, prompt, GREEDY["max_new_tokens"])
    assert len(calls) == GREEDY["max_new_tokens"] - 1  # every decode step
    engine.shutdown()

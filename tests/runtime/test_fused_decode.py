"""`FusedDecodeStep`: a decode step of a Llama-family model as one C++ call
(`arborlm::decode_step`), used by compiled decode where ArborLM's CPU kernels run.

For each architecture it serves (Llama, Llama 3 rope scaling, Mistral, Qwen2 with q/k/v biases;
head dims 16 and 32), in float32 and bfloat16, three requests decoded together by the fused step
(the batch shrinking from 3 to 1 as they finish) must give the same greedy tokens as the eager
engine, with output logprobs equal to rounding (its arithmetic is the eager model's, op for op),
and in float32 the same tokens as `transformers`; every decode step must go through it. Qwen3's
q/k norms are not fused: that model keeps the compiled graph. Bad arguments to the operator are
clear errors.
"""

from __future__ import annotations

import pytest
import torch

from arborlm import Engine
from arborlm.runtime.platforms.cpu import fused_decode
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu import linear as cpu_linear
from tests.runtime.engine_helpers import GREEDY, hf_greedy

# These tests follow the kernels that run without deterministic inference (the causal
# kernel, cascade attention, oneDNN above 128 rows); bfloat16 engines turn it on by default.
NOT_DETERMINISTIC = {"enable_deterministic_inference": False}

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.attention_available(torch.float32) and cpu_linear.packing_available()),
    reason="ArborLM's CPU kernels do not run on this machine")

PROMPT = [(11 * i) % 300 + 6 for i in range(13)]
PROMPTS = [PROMPT, [(7 * i) % 250 + 9 for i in range(5)], [(5 * i) % 280 + 7 for i in range(21)]]
NEW = [12, 6, 9]


def _decode(engine: Engine) -> dict:
    return engine.generate(input_ids=PROMPT, sampling_params=dict(GREEDY, max_new_tokens=12),
                           return_logprob=True)


def _decode_together(engine: Engine) -> list[dict]:
    return engine.generate(input_ids=PROMPTS, sampling_params=[
        dict(GREEDY, max_new_tokens=n) for n in NEW], return_logprob=True)


# Head dim 16 everywhere but the last case, whose 32 takes the vectorized rotary path (and whose
# intermediate size, not a multiple of 16, the SwiGLU's scalar tail).
ARCHS = [("llama", {}), ("llama3", {}), ("mistral", {}), ("qwen2", {}),
         ("llama", {"hidden_size": 128, "intermediate_size": 120})]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch,overrides", ARCHS,
                         ids=["llama", "llama3", "mistral", "qwen2", "llama-head-dim-32"])
def test_fused_step_equals_the_eager_engine(make_tiny_model, monkeypatch, arch, overrides, dtype):
    if dtype == "bfloat16" and not cpu_kernels.available(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16")
    monkeypatch.setattr(cpu_linear, "MIN_PACKED_ELEMENTS", 10_000)  # some packed, some not
    path = str(make_tiny_model(arch, **overrides))
    calls = _count_fused_steps(monkeypatch)
    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC, enable_torch_compile=True) as engine:
        assert isinstance(engine.scheduler.runner.decode, fused_decode.FusedDecodeStep)
        fused = _decode_together(engine)
    # Every decode step after the prefill's token, at batch sizes 3, 2 and 1.
    assert sum(calls) == sum(n - 1 for n in NEW) and set(calls) == {1, 2, 3}
    monkeypatch.setattr(fused_decode, "create_fused_decode", lambda parts: None)
    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC) as engine:  # eager, without the fused step
        assert not isinstance(engine.scheduler.runner.decode, fused_decode.FusedDecodeStep)
        eager = _decode_together(engine)
    _check_equal(path, dtype, fused, eager)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch,overrides", [ARCHS[0], ARCHS[-1]],
                         ids=["llama", "llama-head-dim-32"])
def test_eager_engines_decode_through_the_fused_step(make_tiny_model, monkeypatch, arch,
                                                     overrides, dtype):
    """Without `enable_torch_compile` the fused step needs no compiler: the engine's decode
    steps go through it, with the eager model's results."""
    if dtype == "bfloat16" and not cpu_kernels.available(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16")
    path = str(make_tiny_model(arch, **overrides))
    calls = _count_fused_steps(monkeypatch)
    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC) as engine:
        assert isinstance(engine.scheduler.runner.decode, fused_decode.FusedDecodeStep)
        fused = _decode_together(engine)
    assert sum(calls) == sum(n - 1 for n in NEW) and set(calls) == {1, 2, 3}
    monkeypatch.setattr(fused_decode, "create_fused_decode", lambda parts: None)
    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC) as engine:
        eager = _decode_together(engine)
    _check_equal(path, dtype, fused, eager)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wide_batches_split_the_row_work_over_threads(make_tiny_model, monkeypatch, dtype):
    """20 requests at once: the fused step's per-row work (norms, rotary, SwiGLU, key stores)
    runs on both threads from 16 rows up; tokens and logprobs equal the eager engine's."""
    if dtype == "bfloat16" and not cpu_kernels.available(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16")
    path = str(make_tiny_model("llama"))
    prompts = [[(3 * i + 7 * j) % 300 + 6 for i in range(5 + j)] for j in range(20)]
    params = [dict(GREEDY, max_new_tokens=6 + j % 5) for j in range(20)]
    calls = _count_fused_steps(monkeypatch)
    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC, num_continuous_decode_steps=1) as engine:
        fused = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert max(calls) == 20
    monkeypatch.setattr(fused_decode, "create_fused_decode", lambda parts: None)
    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC) as engine:
        eager = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    for f, e in zip(fused, eager):
        assert f["output_ids"] == e["output_ids"]
        tol = 1e-4 if dtype == "float32" else 2e-2
        assert _logprobs(f) == pytest.approx(_logprobs(e), abs=tol)


def _count_fused_steps(monkeypatch) -> list[int]:
    """The batch size of every fused decode step from now on, in order."""
    calls: list[int] = []
    call = fused_decode.FusedDecodeStep.__call__
    monkeypatch.setattr(fused_decode.FusedDecodeStep, "__call__",
                        lambda self, batch, *rest: calls.append(batch.batch_size)
                        or call(self, batch, *rest))
    return calls


def _check_equal(path: str, dtype: str, fused: list[dict], eager: list[dict]) -> None:
    tol = 1e-4 if dtype == "float32" else 2e-2
    for prompt, n, f, e in zip(PROMPTS, NEW, fused, eager):
        assert f["output_ids"] == e["output_ids"]
        assert _logprobs(f) == pytest.approx(_logprobs(e), abs=tol)
        if dtype == "float32":
            assert f["output_ids"] == hf_greedy(path, prompt, n)


def test_q_k_norms_keep_the_compiled_graph(make_tiny_model):
    with Engine(str(make_tiny_model("qwen3")), dtype="float32",
                enable_torch_compile=True) as engine:
        assert not isinstance(engine.scheduler.runner.decode, fused_decode.FusedDecodeStep)
        out = _decode(engine)
    assert len(out["output_ids"]) == 12


def test_bad_arguments_name_the_problem():
    one = torch.zeros(1, dtype=torch.int64)
    pool = [torch.zeros(8, 1, 16)]
    table = torch.zeros(4, 16)
    with pytest.raises(RuntimeError, match="13 weights expected for 1 layers"):
        torch.ops.arborlm.decode_step(one, one, one, one.view(1, 1), one, [None] * 5, pool, pool,
                                      table, table, 1e-6, 0.25, 1, 1, 16, 32)
    with pytest.raises(RuntimeError, match="weight 0 is missing"):
        torch.ops.arborlm.decode_step(one, one, one, one.view(1, 1), one, [None] * 13, pool, pool,
                                      table, table, 1e-6, 0.25, 1, 1, 16, 32)
    # A linear given as a plain [out, in] matrix, not as panels.
    hidden, vec = 16, torch.ones(16)
    layer = [vec, torch.zeros(48, hidden), None, cpu_kernels.pack_panels(torch.zeros(16, 16)),
             None, vec, cpu_kernels.pack_panels(torch.zeros(64, 16)), None,
             cpu_kernels.pack_panels(torch.zeros(16, 32)), None]
    tail = [torch.zeros(10, hidden), vec, cpu_kernels.pack_panels(torch.zeros(10, 16))]
    with pytest.raises(RuntimeError, match="weight 1 must be the panels of a 16 -> 48 linear"):
        torch.ops.arborlm.decode_step(one, one, one, one.view(1, 1), one, layer + tail, pool,
                                      pool, table, table, 1e-6, 0.25, 1, 1, 16, 32)
    layer[1] = cpu_kernels.pack_panels(torch.zeros(48, hidden))
    two = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="one int64 per request"):
        torch.ops.arborlm.decode_step(two, one, one, one.view(1, 1), one, layer + tail, pool,
                                      pool, table, table, 1e-6, 0.25, 1, 1, 16, 32)
    with pytest.raises(RuntimeError, match=r"slots must be \[2, W\]"):
        torch.ops.arborlm.decode_step(two, two, two, one.view(1, 1), two, layer + tail, pool,
                                      pool, table, table, 1e-6, 0.25, 1, 1, 16, 32)
    with pytest.raises(RuntimeError, match="token 10 outside the vocab"):
        torch.ops.arborlm.decode_step(two + 10, two, two, two.view(2, 1), two, layer + tail,
                                      pool, pool, table, table, 1e-6, 0.25, 1, 1, 16, 32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_requests_on_a_shared_prefix_decode_through_the_fused_step(make_tiny_model, monkeypatch,
                                                                     dtype):
    """Two groups of requests on two cached prefixes, plus one request on neither: every decode
    step runs as one fused call with cascade attention (each group's prefix read once, merged
    with the members' own keys by log-sum-exp), and the results equal the eager engine's
    cascade path (and transformers' tokens in float32)."""
    if dtype == "bfloat16" and not cpu_kernels.available(torch.bfloat16):
        pytest.skip("this CPU lacks AVX512-BF16")
    path = str(make_tiny_model("llama"))
    groups = []
    call = fused_decode.FusedDecodeStep.__call__

    def counting(self, batch, cascade=None):
        groups.append(0 if cascade is None else len(cascade[3]))
        return call(self, batch, cascade)

    monkeypatch.setattr(fused_decode.FusedDecodeStep, "__call__", counting)
    shared = [[(7 * i) % 400 + 10 for i in range(90)],
              [(11 * i) % 300 + 20 for i in range(120)]]  # > CASCADE_MIN_PREFIX tokens
    prompts = [shared[j % 2] + [20 + j, 30 + j, 40 + 2 * j] for j in range(6)]
    prompts.append([(5 * i) % 200 + 8 for i in range(50)])
    params = dict(GREEDY, max_new_tokens=8)

    def run(engine: Engine) -> list[dict]:
        engine.generate(input_ids=[s + [5] for s in shared],
                        sampling_params={"max_new_tokens": 1})  # cache both prefixes
        return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)

    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC) as engine:
        fused = run(engine)
    assert groups.count(2) == params["max_new_tokens"] - 1, groups
    with Engine(path, dtype=dtype, **NOT_DETERMINISTIC, disable_fused_decode=True) as engine:
        eager = run(engine)
    for prompt, f, e in zip(prompts, fused, eager):
        assert f["output_ids"] == e["output_ids"]
        if dtype == "float32":
            assert _logprobs(f) == pytest.approx(_logprobs(e), abs=1e-4)
            assert f["output_ids"] == hf_greedy(path, prompt, params["max_new_tokens"])
    if dtype == "bfloat16":
        # The eager cascade's prefix part is batched bfloat16 matmuls (scores and probabilities
        # rounded to bfloat16), the fused step's float32 tiles: each must be as close to the
        # float32 engine's logprobs as the other, give or take.
        with Engine(path, dtype="float32") as engine:
            exact = run(engine)

        def gap(outs):
            return max(abs(a - b) for o, x in zip(outs, exact)
                       for a, b in zip(_logprobs(o), _logprobs(x)))

        assert gap(fused) <= 1.5 * gap(eager) + 0.01


def _logprobs(out: dict) -> list[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


def test_cascade_arguments_are_checked():
    q = torch.randn(3, 4, 16)
    pool = torch.randn(50, 2, 16)
    slots = torch.arange(20).view(2, 10)
    lens, groups = torch.tensor([10, 8]), torch.tensor([0, -1, 1])
    with pytest.raises(RuntimeError, match="outside 1..10"):
        cpu_kernels.prefix_attention(q, pool, pool, slots, torch.tensor([11, 8]), groups, 0.25)
    with pytest.raises(RuntimeError, match="slot 50 is outside the pool"):
        cpu_kernels.prefix_attention(q, pool, pool, slots + 50, lens, groups, 0.25)
    with pytest.raises(RuntimeError, match="group 2 of row 2 is not one of 2"):
        cpu_kernels.prefix_attention(q, pool, pool, slots, lens, torch.tensor([0, 1, 2]), 0.25)


def test_packed_records_that_do_not_fit_are_refused():
    one = torch.zeros(1, dtype=torch.int64)
    pool = [torch.zeros(8, 1, 32)]
    table = torch.zeros(4, 32)
    hidden, vec = 32, torch.ones(32)
    q8 = 8  # ggml's Q8_0: 34 bytes per 32 values
    layer = [vec, torch.zeros(96, 34, dtype=torch.uint8), None,
             cpu_kernels.pack_panels(torch.zeros(32, 32)), None, vec,
             cpu_kernels.pack_panels(torch.zeros(128, 32)), None,
             cpu_kernels.pack_panels(torch.zeros(32, 64)), None]
    tail = [torch.zeros(10, hidden), vec, cpu_kernels.pack_panels(torch.zeros(10, 32))]
    args = (one, one, one, one.view(1, 1), one, layer + tail, pool, pool, table, table, 1e-6,
            0.25, 1, 1, 32, 64, None, None, None)
    with pytest.raises(RuntimeError, match="quant_path must be"):
        torch.ops.arborlm.decode_step(*args, [1, 0, 1, 1, q8], "fast")
    with pytest.raises(RuntimeError, match="weight 1's packed parts hold 64 rows, not 96"):
        torch.ops.arborlm.decode_step(*args[:5], [vec, torch.zeros(64, 34, dtype=torch.uint8)]
                                      + layer[2:] + tail, *args[6:], [1, 0, 1, 1, q8], "portable")
    with pytest.raises(RuntimeError, match="ggml type 5 has no packed kernel"):
        torch.ops.arborlm.decode_step(*args, [1, 0, 1, 1, 5], "portable")
    with pytest.raises(RuntimeError, match="bad packed record 0"):
        torch.ops.arborlm.decode_step(*args, [1, 7, 1, 1, q8], "portable")
    with pytest.raises(RuntimeError, match="packed part 40 outside the weights"):
        torch.ops.arborlm.decode_step(*args, [1, 1, 2, 1, q8, 40, q8], "portable")

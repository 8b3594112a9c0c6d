"""CUDA-graph decode (`arborlm.runtime.platforms.cuda.graph_runner`).

On CPU: bucket selection and padding as pure functions, the engine options, the clean fallback
(a default CPU engine serves and reports graphs off), and the padded static decode step a graph
captures, run eagerly through the Triton backend in Triton's interpreter against an unpadded
eager step. On a GPU (`-m gpu`, skipped without CUDA): greedy outputs with graphs on equal those
with graphs off for each graph-capable backend.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

if os.environ.get("ARBORLM_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are imported

from arborlm import Engine
from arborlm.errors import InvalidRequestError
from arborlm.runtime.attention.base import CudaGraphShape
from arborlm.runtime.attention.registry import create_attention_backend
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.decode_executor import EagerDecode
from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
from arborlm.runtime.model_runner import ModelRunner
from arborlm.runtime.platforms.cuda.graph_runner import (
    PADDING_ROW,
    CudaGraphRunner,
    DecodeInputBuffers,
    PaddedDecodeStep,
    attention_layer_shape,
    capture_batch_sizes,
    graphs_off_reason,
    padded_batch_size,
)
from tests.runtime.engine_helpers import PROMPTS

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("max_bs, expected", [
    (1, [1]),
    (2, [1, 2]),
    (5, [1, 2, 4, 5]),
    (8, [1, 2, 4, 8]),
    (12, [1, 2, 4, 8, 12]),
    (32, [1, 2, 4, 8, 16, 24, 32]),
    (40, [1, 2, 4, 8, 16, 24, 32, 40]),
])
def test_capture_batch_sizes(max_bs, expected):
    assert capture_batch_sizes(max_bs) == expected


@pytest.mark.parametrize("max_bs", [1, 5, 12, 32])
def test_padded_batch_size_is_the_smallest_bucket_that_fits(max_bs):
    sizes = capture_batch_sizes(max_bs)
    for bs in range(1, max_bs + 1):
        padded = padded_batch_size(bs, sizes)
        assert padded in sizes and padded >= bs
        assert all(s < bs for s in sizes if s < padded)
    assert padded_batch_size(max_bs + 1, sizes) is None


def _decode_inputs(rows: list[list[int]]) -> ForwardBatch:
    """A decode batch carrying only the five per-row inputs (`rows[i]` in FIELDS order)."""
    t = torch.tensor(rows, dtype=torch.int64).T  # [5, B]
    return ForwardBatch(mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=t[0],
                        positions=t[1], req_pool_indices=t[2], seq_lens=t[3],
                        out_cache_loc=t[4], req_to_token_pool=None, kv_pool=None,
                        seq_lens_cpu=t[3].tolist())


def test_input_buffers_pad_and_repad_stale_rows():
    buffers = DecodeInputBuffers(8, "cpu")
    pad = torch.tensor(PADDING_ROW)[:, None]  # [5, 1]
    assert torch.equal(buffers.data, pad.expand(5, 8))
    big = [[10 + i, 20 + i, 1 + i, 21 + i, 100 + i] for i in range(6)]
    buffers.load(_decode_inputs(big), 8)
    small = [[7, 3, 5, 4, 50], [8, 9, 2, 10, 51]]
    buffers.load(_decode_inputs(small), 4)
    assert torch.equal(buffers.data[:, :2], torch.tensor(small).T)
    assert torch.equal(buffers.data[:, 2:4], pad.expand(5, 2))  # stale rows of `big` re-padded
    assert torch.equal(buffers.field("seq_lens", 4), torch.tensor([4, 10, 1, 1]))
    assert buffers.field("out_cache_loc", 4).data_ptr() == buffers.data[4].data_ptr()


def test_engine_args_options():
    args = EngineArgs()
    assert args.disable_cuda_graph is False and args.cuda_graph_max_bs == 32
    with pytest.raises(InvalidRequestError) as e:
        EngineArgs(cuda_graph_max_bs=0).resolve()
    assert e.value.param == "cuda_graph_max_bs"
    from arborlm.server.cli import build_parser

    ns = build_parser().parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "16"])
    assert ns.disable_cuda_graph is True and ns.cuda_graph_max_bs == 16


def test_graphs_off_reasons():
    native = create_attention_backend("torch_native", "cpu")
    triton = create_attention_backend("triton", "cpu")
    f32 = torch.float32
    assert "disable_cuda_graph" in graphs_off_reason(EngineArgs(disable_cuda_graph=True),
                                                     "cuda", triton, f32)
    assert graphs_off_reason(EngineArgs(), "cpu", triton, f32) == "device is cpu"
    assert "TorchNativeBackend" in native.cuda_graph_unsupported_reason(f32)
    assert triton.cuda_graph_unsupported_reason(torch.bfloat16) is None
    if HAS_CUDA:
        assert "TorchNativeBackend" in graphs_off_reason(EngineArgs(), "cuda", native, f32)
        assert graphs_off_reason(EngineArgs(), "cuda", triton, f32) is None
    else:
        assert graphs_off_reason(EngineArgs(), "cuda", triton, f32) == "CUDA is not available"
    flashinfer = create_attention_backend("flashinfer", "cpu")
    assert flashinfer.cuda_graph_unsupported_reason(f32) is None  # served by triton
    try:
        import flashinfer as _  # noqa: F401
    except ImportError:
        assert "flashinfer" in flashinfer.cuda_graph_unsupported_reason(torch.bfloat16)


def test_default_cpu_engine_runs_eagerly_and_logs_why(make_tiny_model, caplog):
    caplog.set_level(logging.INFO, logger="arborlm.runtime.platforms.cuda.graph_runner")
    with Engine(str(make_tiny_model("llama")), dtype="float32", max_total_tokens=2048) as engine:
        out = engine.generate(PROMPTS[:2], {"temperature": 0, "max_new_tokens": 3})
        assert [len(o["output_ids"]) for o in out] == [3, 3]
        assert not isinstance(engine.scheduler.runner.decode, CudaGraphRunner)
    assert "CUDA graphs off: device is cpu" in caplog.text


def _decode_batch(runner: ModelRunner, rows: list[int], lens: list[int],
                  gen: torch.Generator) -> ForwardBatch:
    """A decode step of requests in req_to_token `rows` whose new token is at position
    `lens[i] - 1`; every KV slot holds random values (the padding slot 0 included)."""
    for row, n in zip(rows, lens):
        runner.req_to_token_pool.write(row, 0, runner.allocator.alloc_range(0, n, 0))
    for buf in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    table = runner.req_to_token_pool.req_to_token
    last = torch.tensor([n - 1 for n in lens])
    rows_t = torch.tensor(rows)
    return ForwardBatch(
        mode=ForwardMode.DECODE, batch_size=len(rows),
        input_ids=torch.randint(10, runner.vocab_size, (len(rows),), generator=gen),
        positions=last, req_pool_indices=rows_t, seq_lens=torch.tensor(lens),
        out_cache_loc=table[rows_t, last], req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool, seq_lens_cpu=list(lens), logits_indices=torch.arange(len(rows)))


@pytest.mark.triton_interpret
@pytest.mark.skipif(os.environ.get("ARBORLM_TEST_DEVICE", "cpu") != "cpu",
                    reason="interpreter run; the GPU tests below replay real graphs")
def test_padded_static_decode_step_matches_eager(make_tiny_model):
    """What a graph captures, run eagerly: padding rows (reading row 0, which is live here)
    and the fixed split grid change no real row's logits."""
    from arborlm.runtime.attention.triton_kernels import INTERPRET
    from arborlm.runtime.attention.triton_kernels.decode_attention import SPLIT_CHUNK

    if not INTERPRET:
        pytest.skip("Triton was imported without TRITON_INTERPRET=1 in this process")
    args = EngineArgs(model_path=str(make_tiny_model("llama")), dtype="float32",
                      attention_backend="triton", max_total_tokens=512, max_running_requests=8)
    runner = ModelRunner(args.resolve())
    assert not isinstance(runner.decode, CudaGraphRunner)
    lens = [5, SPLIT_CHUNK + 8, 3 * SPLIT_CHUNK + 4]  # 1, 2 and 4 kv splits
    batch = _decode_batch(runner, [3, 0, 5], lens, torch.Generator().manual_seed(0))
    expected = runner.forward(batch)  # [3, V], eager (grid from the longest sequence)
    backend, layer = runner.attn_backend, attention_layer_shape(runner.model)
    backend.init_cuda_graph_state(CudaGraphShape(
        max_bs=8, max_context_len=runner.req_to_token_pool.max_context_len, layer=layer,
        kv_dtype=torch.float32, device=torch.device("cpu")))
    step = PaddedDecodeStep(runner.model, backend, runner.req_to_token_pool, runner.kv_pool,
                            8, "cpu")
    with torch.inference_mode():
        step.run(step.capture_batch(4))  # a capture-time run over padding rows only
        step.buffers.data[:, 3:].fill_(7)  # stale rows of an earlier, larger step
        logits = step.run(step.prepare(batch, 4))  # [4, V]
    assert logits.shape == (4, runner.vocab_size)
    torch.testing.assert_close(logits[:3], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[:3].argmax(-1), expected.argmax(-1))
    assert torch.equal(step.buffers.field("seq_lens", 4)[3:], torch.tensor([1]))


def _flashinfer_installed() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def _skip_unless(backend: str) -> None:
    if backend == "flashinfer" and not _flashinfer_installed():
        pytest.skip("flashinfer is not installed")


GPU_CASES = [("triton", "float32"), ("triton", "bfloat16"), ("flashinfer", "bfloat16")]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("backend, dtype", GPU_CASES)
def test_replayed_logits_match_eager(make_tiny_model, backend, dtype):
    """A replayed step (3 requests padded to 4, one of them in req_to_token row 0, up to 700
    positions) gives the logits of the same step run eagerly."""
    _skip_unless(backend)
    args = EngineArgs(model_path=str(make_tiny_model("llama")), dtype=dtype, device="cuda",
                      attention_backend=backend, max_total_tokens=2048,
                      max_running_requests=8, cuda_graph_max_bs=8)
    runner = ModelRunner(args.resolve())
    assert isinstance(runner.decode, CudaGraphRunner)
    assert runner.decode.batch_sizes == [1, 2, 4, 8]
    batch = _decode_batch(runner, [3, 0, 5], [5, 300, 700], torch.Generator().manual_seed(0))
    for name in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc",
                 "logits_indices"):
        setattr(batch, name, getattr(batch, name).cuda())
    replayed = runner.forward(batch).clone()  # [3, V]
    runner.decode = EagerDecode()  # the same runner, eager from here on
    eager = runner.forward(batch)
    assert replayed.shape == eager.shape == (3, runner.vocab_size)
    scale = float(eager.abs().max())
    tol = 1e-4 if dtype == "float32" else 2e-2
    assert float((replayed - eager).abs().max()) <= tol * scale


def _greedy(path: str, backend: str, dtype: str, **options) -> tuple[list[list[int]], bool]:
    with Engine(path, device="cuda", attention_backend=backend, dtype=dtype,
                max_total_tokens=8192, **options) as engine:
        captured = isinstance(engine.scheduler.runner.decode, CudaGraphRunner)
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        outs = [o["output_ids"] for o in engine.generate(PROMPTS, params)]
        outs += [o["output_ids"] for o in engine.generate(PROMPTS[:3], params)]  # padded to 4
        outs += [engine.generate(PROMPTS[1], params)["output_ids"]]
    torch.cuda.empty_cache()
    return outs, captured


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_greedy_graphs_on_equals_off(make_tiny_model):
    """float32 greedy tokens are the same with graphs on and off, for batches of 8, 3 (padded
    to 4) and 1. (Half precision is compared by `benchmarks/gpu_check.py`, where a near-tie
    may flip a token: a padded batch's matmuls may round differently.)"""
    path = str(make_tiny_model("llama"))
    off, captured_off = _greedy(path, "triton", "float32", disable_cuda_graph=True)
    on, captured_on = _greedy(path, "triton", "float32", cuda_graph_max_bs=8)
    assert not captured_off and captured_on
    assert on == off

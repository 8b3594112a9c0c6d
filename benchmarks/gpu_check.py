"""GPU check of the attention backends and CUDA graphs, in one command (minutes on one H200).

1. Kernel tests on the GPU: `tests/runtime/attention` with `ARBORLM_TEST_DEVICE=cuda` and
   without `TRITON_INTERPRET` (Triton compiled for the GPU; FlashInfer cases when installed).
2. Attention-op timings per backend on a Llama-3-8B layer shape (32 query heads, 8 KV heads,
   head size 128, bfloat16): decode (KV bytes read per second and its fraction of the peak
   memory bandwidth) and prefill (TFLOP/s). Needs no engine.
3. Greedy equality: each backend against `torch_native` through `arborlm.Engine` on a tiny
   random Llama, 32 greedy tokens for 8 prompts. float32 must match token for token. In
   bfloat16 every backend, torch_native included, drifts from the float32 tokens at some
   near-tie, so there a backend must track the float32 tokens at least half as long as
   torch_native does (see `greedy_equality`).
4. Engine timings per backend on a ~0.7B-parameter random Llama in bfloat16: prefill tokens/s,
   batch-1 decode tokens/s, and for batch-1 decode the bytes read per token (weights + KV) per
   second as a fraction of the peak memory bandwidth (`--peak-bw`, 4.8e12 for an H200). CUDA
   graphs are at their default here: on for triton and flashinfer.
5. CUDA graphs, for each backend that captures them (triton, flashinfer): the GPU tests of
   `tests/runtime/test_cuda_graph.py` (replayed logits vs eager, float32 greedy on vs off);
   greedy outputs with graphs on vs off on the tiny Llama (float32 identical; bfloat16 judged
   like section 3, with graphs off as the half-precision baseline); and decode tokens/s with
   graphs off vs on on the timing model at batch 1 and 16.
6. Tensor parallelism over NCCL, on a machine with at least 2 GPUs (else reported as skipped):
   `--tp-size 2` greedy outputs against one GPU's on the tiny Llama (float32, token for token;
   triton backend, graphs off, as sharded engines decode eagerly), and decode tokens/s at batch
   1 and 16 on the timing model for one GPU (graphs on and off) and two.

    python benchmarks/gpu_check.py [--peak-bw 4.8e12] [--skip-tests] [--skip-engine]

Exits 2 with a message when no CUDA device is present, 1 when a check fails, else 0. This
script checks and measures; it does not tune block sizes or compare against other engines.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GREEDY_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def add(a, b):",
    '{"name": "Ada", "age":',
    "1 2 3 4 5",
    "A",
    "In the beginning the universe was created. " * 12,
    "Hello " * 60,
]
TIMING_MODEL = dict(vocab_size=512, hidden_size=2048, intermediate_size=5632, num_layers=16,
                    num_heads=16, num_kv_heads=4, max_position_embeddings=4096,
                    dtype="bfloat16", init_std=0.02)


Check = tuple[str, bool, str]  # (name, passed, detail)


def guarded(checks: list[Check], name: str, fn: Callable[[], Any]) -> Any:
    """Run `fn`; on an exception record a failed check and return None, so one broken backend
    does not hide the results of the others."""
    try:
        return fn()
    except Exception as e:  # reported as a failed check, not swallowed
        traceback.print_exc(limit=4)
        checks.append((name, False, f"{type(e).__name__}: {e}"))
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        return None


def available_backends() -> list[str]:
    names = ["torch_native", "triton"]
    if importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    return names


GRAPH_BACKENDS = ("triton", "flashinfer")


def run_kernel_tests(timeout_s: int, path: str = "tests/runtime/attention") -> tuple[bool, str]:
    env = dict(os.environ, ARBORLM_TEST_DEVICE="cuda")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s} s"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode != 0:
        print("\n".join(lines[-40:]))
    return proc.returncode == 0, lines[-1] if lines else "no output"


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _engine(path: Path, backend: str, dtype: str, graphs: bool | None = None):
    """An engine; `graphs` True/False forces CUDA graphs on/off (None: the default), and True
    raises when the engine fell back to eager decoding."""
    from arborlm import Engine

    options = {} if graphs is None else {"disable_cuda_graph": not graphs}
    engine = Engine(str(path), attention_backend=backend, device="cuda", dtype=dtype,
                    max_total_tokens=32768, **options)
    from arborlm.runtime.platforms.cuda.graph_runner import CudaGraphRunner

    if graphs and not isinstance(engine.scheduler.runner.decode, CudaGraphRunner):
        engine.shutdown()
        raise RuntimeError("CUDA graphs were not captured (see the log for why)")
    return engine


def _greedy_ids(path: Path, backend: str, dtype: str,
                graphs: bool | None = None) -> list[list[int]]:
    with _engine(path, backend, dtype, graphs) as engine:
        outs = engine.generate(GREEDY_PROMPTS, {"temperature": 0, "max_new_tokens": 32})
    _release()
    return [o["output_ids"] for o in outs]


def _agreement(a: list[int], b: list[int]) -> int:
    """Tokens two greedy outputs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_equality(reference: list[list[int]], got: list[list[int]],
                    native_half: list[list[int]] | None = None) -> tuple[bool, str]:
    """(passed, detail) for one backend's greedy outputs.

    float32 (`native_half` None): identical to torch_native's float32 outputs. In half precision
    every backend drifts from float32 at some near-tie (torch_native too: with a random model the
    first flip comes after ~10 tokens), so a backend passes when its outputs agree with the
    float32 ones for at least half as many tokens, on average, as torch_native's half-precision
    outputs do; a wrong mask or a wrong gather diverges at once.
    """
    agree = [_agreement(g, r) for g, r in zip(got, reference)]
    if native_half is None:
        differ = [a for a, g, r in zip(agree, got, reference) if g != r]
        detail = f"{len(got) - len(differ)}/{len(got)} prompts identical"
        return not differ, detail + (f"; the others diverge at tokens {differ}" if differ else "")
    mine = sum(agree) / len(agree)
    base = sum(_agreement(n, r) for n, r in zip(native_half, reference)) / len(agree)
    same = sum(g == n for g, n in zip(got, native_half))
    return mine >= 0.5 * base, (
        f"agrees with float32 for {mine:.1f} tokens on average (torch_native: {base:.1f}); "
        f"{same}/{len(got)} prompts identical to torch_native in this dtype")


def _attention_case(backend_name: str, bsz: int, ctx: int, new: int, decode: bool):
    """A one-layer batch with contiguous slots: `bsz` requests of `ctx` tokens, `new` of them
    new. Returns (backend, q, layer, batch)."""
    from arborlm.runtime.attention.base import AttentionLayerSpec
    from arborlm.runtime.attention.registry import create_attention_backend
    from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
    from arborlm.runtime.memory_pool import KVPool, ReqToTokenPool

    heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    pool = KVPool(bsz * ctx + 1, 1, kv_heads, head_dim, dtype, device="cuda")
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    rtt = ReqToTokenPool(bsz, ctx, device="cuda")
    rtt.req_to_token.copy_(1 + torch.arange(bsz * ctx, device="cuda").view(bsz, ctx))
    out_loc = rtt.req_to_token[:, ctx - new:].reshape(-1)  # [bsz*new]
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=bsz,
        input_ids=torch.zeros(bsz * new, dtype=torch.int64, device="cuda"),
        positions=torch.arange(ctx - new, ctx, device="cuda").repeat(bsz),
        req_pool_indices=torch.arange(bsz, device="cuda"),
        seq_lens=torch.full((bsz,), ctx, dtype=torch.int64, device="cuda"),
        out_cache_loc=out_loc, req_to_token_pool=rtt, kv_pool=pool, seq_lens_cpu=[ctx] * bsz,
        extend_prefix_lens_cpu=[] if decode else [ctx - new] * bsz,
        extend_seq_lens_cpu=[] if decode else [new] * bsz)
    layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim ** -0.5)
    q = torch.randn(bsz * new, heads, head_dim, dtype=dtype, device="cuda")  # [T, H, D]
    backend = create_attention_backend(backend_name, "cuda")
    backend.init_forward_metadata(batch)
    return backend, q, layer, batch


def _cuda_time(fn, iters: int = 20) -> float:
    """Mean seconds per call, after warm-up (which also compiles)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def attention_timings(backend: str, peak_bw: float) -> list[str]:
    rows = []
    for bsz, ctx in ((1, 32768), (32, 4096)):
        be, q, layer, batch = _attention_case(backend, bsz, ctx, 1, decode=True)
        t = _cuda_time(functools.partial(be.forward_decode, q, layer, batch))
        kv_bytes = bsz * ctx * layer.num_kv_heads * layer.head_dim * 2 * 2  # K and V, bf16
        rows.append(f"decode  B={bsz:<2} ctx={ctx:<5} {t * 1e6:8.1f} us  "
                    f"{kv_bytes / t / 1e9:7.0f} GB/s  {kv_bytes / t / peak_bw:6.1%} of peak BW")
        del be, q, batch
        _release()
    for bsz, ctx, new in ((4, 2048, 2048), (1, 8192, 1024)):
        be, q, layer, batch = _attention_case(backend, bsz, ctx, new, decode=False)
        t = _cuda_time(functools.partial(be.forward_extend, q, layer, batch))
        keys = sum(ctx - new + i + 1 for i in range(new)) * bsz
        flops = 4 * layer.num_heads * layer.head_dim * keys
        rows.append(f"prefill B={bsz} new={new} prefix={ctx - new:<5} {t * 1e6:8.1f} us  "
                    f"{flops / t / 1e12:6.1f} TFLOP/s")
        del be, q, batch
        _release()
    return rows


def weight_bytes_per_token(path: Path, dtype_bytes: int) -> int:
    """Bytes of weights a decode step reads: all tensors but the input embedding (one row of
    it is read), unless the embedding is also the output head."""
    from safetensors import safe_open

    total, embed = 0, 0
    names = set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                numel = 1
                for d in st.get_slice(name).get_shape():
                    numel *= d
                names.add(name)
                total += numel
                embed += numel if "embed_tokens" in name else 0
    tied = not any("lm_head" in n for n in names)
    return (total if tied else total - embed) * dtype_bytes


def _timed_generate(engine, prompts: list[list[int]], new: int) -> float:
    params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def engine_timings(path: Path, backend: str, peak_bw: float) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    prefill_prompts = torch.randint(10, 500, (8, 1024), generator=gen).tolist()
    decode_prompt = torch.randint(10, 500, (1, 512), generator=gen).tolist()
    steps = 128
    with _engine(path, backend, "bfloat16") as engine:
        cfg = engine.config.model
        _timed_generate(engine, prefill_prompts[:2], 4)  # warm-up: compiles kernels
        t_prefill = min(_timed_generate(engine, prefill_prompts, 1) for _ in range(2))
        t_first = min(_timed_generate(engine, decode_prompt, 1) for _ in range(2))
        t_all = min(_timed_generate(engine, decode_prompt, steps) for _ in range(2))
    _release()
    t_decode = max(t_all - t_first, 1e-9) / (steps - 1)  # per decode step
    kv_per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K+V, bf16
    mean_ctx = 512 + steps / 2
    bytes_per_step = weight_bytes_per_token(path, 2) + kv_per_pos * mean_ctx
    return [f"prefill 8x1024 tokens: {8 * 1024 / t_prefill:9.0f} tokens/s",
            f"decode batch 1 (ctx 512..640): {1 / t_decode:7.1f} tokens/s, "
            f"{bytes_per_step / 1e9:.2f} GB/token -> {bytes_per_step / t_decode / 1e9:6.0f} GB/s "
            f"= {bytes_per_step / t_decode / peak_bw:.1%} of peak BW"]


def cuda_graph_timings(path: Path, backend: str) -> list[str]:
    """Decode tokens/s with CUDA graphs off and on, at batch 1 and 16 (prompts of 256)."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, 500, (16, 256), generator=gen).tolist()
    steps = 64
    rates: dict[tuple[bool, int], float] = {}
    for graphs in (False, True):
        with _engine(path, backend, "bfloat16", graphs) as engine:
            _timed_generate(engine, prompts[:2], 4)  # warm-up: compiles kernels
            for bs in (1, 16):
                t_first = min(_timed_generate(engine, prompts[:bs], 1) for _ in range(2))
                t_all = min(_timed_generate(engine, prompts[:bs], steps) for _ in range(2))
                rates[graphs, bs] = bs * (steps - 1) / max(t_all - t_first, 1e-9)
        _release()
    return [f"decode batch {bs:<2} (ctx 256..320): graphs off {rates[False, bs]:8.1f}, "
            f"on {rates[True, bs]:8.1f} tokens/s ({rates[True, bs] / rates[False, bs]:.2f}x)"
            for bs in (1, 16)]


def _graph_greedy_checks(path: Path, backend: str, checks: list[Check]) -> None:
    """Graphs on vs off: float32 identical; bfloat16 judged by `greedy_equality` with the
    graphs-off bfloat16 outputs as the half-precision baseline."""
    off = {dtype: guarded(checks, f"greedy {backend} graphs off ({dtype})",
                          lambda: _greedy_ids(path, backend, dtype, False))  # noqa: B023
           for dtype in ("float32", "bfloat16")}
    if off["float32"] is None:
        return
    for dtype in ("float32", "bfloat16"):
        name = f"greedy {backend} graphs on vs off ({dtype})"
        got = guarded(checks, name, lambda: _greedy_ids(path, backend, dtype, True))  # noqa: B023
        if got is None or (dtype == "bfloat16" and off[dtype] is None):
            continue
        baseline = None if dtype == "float32" else off[dtype]
        ok, detail = greedy_equality(off["float32"], got, baseline)
        checks.append((name, ok, detail))
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)


def _cuda_graph_checks(tiny: Path, big: Path, backends: list[str], test_timeout: int,
                       checks: list[Check]) -> None:
    graph_backends = [b for b in backends if b in GRAPH_BACKENDS]
    _section("CUDA graphs: tests/runtime/test_cuda_graph.py on the GPU")
    ok, detail = run_kernel_tests(test_timeout, "tests/runtime/test_cuda_graph.py")
    checks.append(("CUDA-graph tests", ok, detail))
    print(f"{'ok  ' if ok else 'FAIL'} {detail}", flush=True)
    _section("CUDA graphs: greedy on vs off (tiny Llama, 32 greedy tokens, 8 prompts)")
    for backend in graph_backends:
        _graph_greedy_checks(tiny, backend, checks)
    _section("CUDA graphs: decode off vs on (random Llama, 16 layers, hidden 2048, bfloat16)")
    for backend in graph_backends:
        rows = guarded(checks, f"CUDA-graph timing {backend}",
                       lambda: cuda_graph_timings(big, backend))  # noqa: B023
        for row in rows or []:
            print(f"{backend:>12}  {row}", flush=True)


def _tp_engine(path: Path, dtype: str, tp: int, graphs: bool = False):
    from arborlm import Engine

    return Engine(str(path), attention_backend="triton", device="cuda", dtype=dtype,
                  max_total_tokens=32768, tp_size=tp, disable_cuda_graph=not graphs)


def tp_greedy(path: Path) -> tuple[bool, str]:
    """TP=2 against TP=1 greedy outputs, float32 (must be identical), the ranks' collectives
    on NCCL (a group on another backend fails the check)."""
    ids, backend = {}, None
    for tp in (1, 2):
        with _tp_engine(path, "float32", tp) as engine:
            if tp > 1:
                backend = engine.client.scheduler.runner.leader.group.backend
            outs = engine.generate(GREEDY_PROMPTS, {"temperature": 0, "max_new_tokens": 32})
        ids[tp] = [o["output_ids"] for o in outs]
        _release()
    ok, detail = greedy_equality(ids[1], ids[2])
    return ok and backend == "nccl", f"{detail}; collectives on {backend}"


def tp_timings(path: Path) -> list[str]:
    """Decode tokens/s at batch 1 and 16 (prompts of 256): TP=1 graphs on / off, TP=2."""
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(10, 500, (16, 256), generator=gen).tolist()
    steps = 64
    rows = []
    for tp, graphs in ((1, True), (1, False), (2, False)):
        with _tp_engine(path, "bfloat16", tp, graphs) as engine:
            _timed_generate(engine, prompts[:2], 4)  # warm-up: compiles kernels
            rates = []
            for bs in (1, 16):
                t_first = min(_timed_generate(engine, prompts[:bs], 1) for _ in range(2))
                t_all = min(_timed_generate(engine, prompts[:bs], steps) for _ in range(2))
                rates.append(bs * (steps - 1) / max(t_all - t_first, 1e-9))
        _release()
        rows.append(f"TP={tp} graphs {'on ' if graphs else 'off'}: decode batch 1 "
                    f"{rates[0]:8.1f}, batch 16 {rates[1]:8.1f} tokens/s")
    return rows


def _tp_checks(tiny: Path, big: Path, checks: list[Check]) -> None:
    _section("tensor parallelism: --tp-size 2 over NCCL")
    if torch.cuda.device_count() < 2:
        print(f"skipped: {torch.cuda.device_count()} GPU(s); tensor parallelism needs one GPU "
              f"per rank", flush=True)
        return
    result = guarded(checks, "TP=2 greedy (float32)", lambda: tp_greedy(tiny))
    if result is not None:
        ok, detail = result
        checks.append(("TP=2 vs TP=1 greedy (float32)", ok, detail))
        print(f"{'ok  ' if ok else 'FAIL'} TP=2 vs TP=1 greedy (float32): {detail}", flush=True)
    for row in guarded(checks, "TP timing", lambda: tp_timings(big)) or []:
        print(row, flush=True)


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def _greedy_checks(path: Path, backends: list[str], checks: list[Check]) -> None:
    reference = guarded(checks, "greedy torch_native (float32)",
                        lambda: _greedy_ids(path, "torch_native", "float32"))
    native_half = guarded(checks, "greedy torch_native (bfloat16)",
                          lambda: _greedy_ids(path, "torch_native", "bfloat16"))
    if reference is None or native_half is None:
        return
    for backend in backends[1:]:
        for dtype, native in (("float32", None), ("bfloat16", native_half)):
            name = f"greedy {backend} ({dtype})"
            got = guarded(checks, name, lambda: _greedy_ids(path, backend, dtype))  # noqa: B023
            if got is not None:
                ok, detail = greedy_equality(reference, got, native)
                checks.append((name, ok, detail))
                print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)


def _engine_checks(backends: list[str], peak_bw: float, test_timeout: int,
                   checks: list[Check]) -> None:
    from arborlm.runtime.models.factory import build_model

    with tempfile.TemporaryDirectory(prefix="arborlm-gpu-check-") as tmp:
        _section("greedy equality (tiny Llama, 32 greedy tokens, 8 prompts)")
        tiny = build_model(Path(tmp) / "tiny", "llama", hidden_size=256, intermediate_size=512,
                           num_layers=2, num_heads=4, num_kv_heads=2, init_std=0.2)
        _greedy_checks(tiny, backends, checks)
        _section("engine timings (random Llama, 16 layers, hidden 2048, bfloat16)")
        t = time.perf_counter()
        big = build_model(Path(tmp) / "timing", "llama", **TIMING_MODEL)
        print(f"built the timing model in {time.perf_counter() - t:.0f} s", flush=True)
        for backend in backends:
            rows = guarded(checks, f"engine timing {backend}",
                           lambda: engine_timings(big, backend, peak_bw))  # noqa: B023
            for row in rows or []:
                print(f"{backend:>12}  {row}", flush=True)
        _cuda_graph_checks(tiny, big, backends, test_timeout, checks)
        _tp_checks(tiny, big, checks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peak-bw", type=float, default=4.8e12,
                    help="peak memory bandwidth in bytes/s (H200: 4.8e12, H100 SXM: 3.35e12)")
    ap.add_argument("--skip-tests", action="store_true", help="skip the kernel tests")
    ap.add_argument("--skip-engine", action="store_true",
                    help="skip greedy equality and engine timings (attention timings only)")
    ap.add_argument("--test-timeout", type=int, default=180)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device is available (torch.cuda.is_available() is False); "
              "this check needs an NVIDIA GPU.", file=sys.stderr)
        return 2
    start = time.perf_counter()
    backends = available_backends()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  backends: "
          f"{', '.join(backends)}" + ("" if "flashinfer" in backends
                                      else "  (flashinfer not installed: skipped)"))
    checks: list[Check] = []
    if not args.skip_tests:
        _section("kernel tests on the GPU")
        ok, detail = run_kernel_tests(args.test_timeout)
        checks.append(("kernel tests", ok, detail))
        print(f"{'ok  ' if ok else 'FAIL'} {detail}", flush=True)
    _section("attention op timings (H=32, Hkv=8, D=128, bfloat16; per layer call)")
    for backend in backends:
        rows = guarded(checks, f"attention timing {backend}",
                       lambda: attention_timings(backend, args.peak_bw))  # noqa: B023
        for row in rows or []:
            print(f"{backend:>12}  {row}", flush=True)
    if not args.skip_engine:
        guarded(checks, "engine checks",
                lambda: _engine_checks(backends, args.peak_bw, args.test_timeout, checks))
    failed = [c for c in checks if not c[1]]
    print(f"\n{len(checks) - len(failed)}/{len(checks)} checks passed in "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

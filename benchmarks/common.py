"""Shared pieces of the benchmarks: machine peak, model FLOPs, workloads, and printing."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def off_main_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on a short-lived thread (its result, or its error raised here).

    Torch work outside the engines (building a model, a matmul peak, a transformers peer) must
    not run on the benchmark's own thread: the thread would keep an OpenMP team for the rest of
    the run, and with more OpenMP threads than cores libgomp stops spinning between parallel
    regions, which slows the in-process engine's scheduler thread (docs/serving.md, "On a
    CPU"). A thread's team ends with the thread.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def matmul_peak_gflops(dtype: torch.dtype = torch.float32, n: int = 1024,
                       repeats: int = 5) -> float:
    """Median GFLOP/s of an n×n×n matmul with torch's threads: the machine's practical peak."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        times.append((time.perf_counter() - t) / 4)
    return 2 * n**3 / statistics.median(times) / 1e9


def linear_params(cfg) -> int:
    """Parameters of the matmuls run per token (all linears including lm_head, no embedding)."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return layers * per_layer + h * cfg.vocab_size


def model_flops(cfg, prompt_lens: list[int], new_tokens: list[int]) -> float:
    """Forward FLOPs to prefill every prompt and decode its new tokens (matmuls + attention)."""
    p = linear_params(cfg)
    attn = 0.0
    tokens = 0
    per_tok_attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # QK^T and PV per key
    for n, m in zip(prompt_lens, new_tokens):
        tokens += n + m
        attn += per_tok_attn * (n * (n + 1) / 2 + sum(n + k for k in range(m)))
    return 2 * p * tokens + attn


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0,
                   avoid: set[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    avoid = avoid or set()
    pool = [t for t in range(vocab) if t not in avoid]
    return [[rng.choice(pool) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def table(rows: list[tuple], header: tuple) -> str:
    cols = list(zip(header, *rows))
    widths = [max(len(str(x)) for x in c) for c in cols]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(lines)

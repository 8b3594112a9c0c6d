"""CPU decode: the fused C++ step (`arborlm::decode_step`) against the compiled Inductor graph
it replaces, on the benchmark models of `cpu_vs_llamacpp.py`, at batch 1 and with 32 requests
decoding together (32-token prompts), in one run.

One engine per (model, dtype) with `enable_torch_compile` (whose decode executor is the fused
step) and a compiled executor built beside it from the same parts: rounds alternate between
them (the runner's `decode` executor swapped), each timing decode alone as
`new / (time of 1 + new tokens - time of 1 token)`. Prints both medians in ms per step and the
median of the per-round graph/fused ratios (above 1: the fused step is faster).

    python benchmarks/cpu_decode_step.py [--threads 2] [--rounds 9] [--new 64] [--batch 1 32]

CPUs without ArborLM's kernels (x86-64 with AVX-512) have no fused step; the script says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import off_main_thread, random_prompts, table  # noqa: E402
from cpu_vs_llamacpp import SPECIALS, build_models  # noqa: E402

CASES = [("32M", "float32"), ("32M", "bfloat16"), ("125M", "float32")]


def ms_per_step(engine, prompts: list[list[int]], new: int) -> float:
    def wall(n: int) -> float:
        engine.flush_cache()
        t = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                            "max_new_tokens": n,
                                                            "ignore_eos": True})
        return time.perf_counter() - t

    return (wall(new + 1) - wall(1)) / new * 1e3


def compare(path: Path, dtype: str, rounds: int, new: int, batch: int) -> tuple | None:
    from arborlm import Engine
    from arborlm.runtime.platforms.cpu.compiled_decode import CompiledDecodeRunner
    from arborlm.runtime.platforms.cpu.fused_decode import FusedDecodeStep

    engine = Engine(str(path), dtype=dtype, max_total_tokens=4096, enable_torch_compile=True)
    try:
        runner = engine.scheduler.runner
        fused = runner.decode
        if not isinstance(fused, FusedDecodeStep):
            return None
        args = runner.config.args
        executors = {"fused": fused, "graph": CompiledDecodeRunner(
            runner.decode_parts, min(args.torch_compile_max_bs, args.max_running_requests))}
        prompts = random_prompts(batch, 32, 32, 8192, seed=1, avoid=SPECIALS)
        times: dict[str, list[float]] = {"fused": [], "graph": []}
        for _ in range(rounds):
            for name in times:
                runner.decode = executors[name]
                times[name].append(ms_per_step(engine, prompts, new))
        runner.decode = fused
    finally:
        engine.shutdown()
    ratio = statistics.median(g / f for f, g in zip(times["fused"], times["graph"]))
    return (f"{statistics.median(times['fused']):.3f} ms",
            f"{statistics.median(times['graph']):.3f} ms", f"{ratio:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--new", type=int, default=64, help="decoded tokens per timed generate")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32],
                    help="requests decoding together")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from arborlm.runtime.models.factory import cache_root

    paths = off_main_thread(build_models, cache_root() / "bench-cpu")
    rows = []
    for batch in args.batch:
        for model, dtype in CASES:
            row = compare(paths[model], dtype, args.rounds, args.new, batch)
            if row is None:
                print("no fused decode step here (it needs ArborLM's CPU kernels: x86-64, "
                      "AVX-512)")
                return
            rows.append((batch, model, dtype, *row))
    print(f"threads {args.threads}; medians of {args.rounds} alternating rounds of {args.new} "
          f"tokens; ratio = graph / fused")
    print(table(rows, ("batch", "model", "dtype", "fused step", "compiled graph", "ratio")))


if __name__ == "__main__":
    main()

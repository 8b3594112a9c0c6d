"""`quant_linear` (linears from GGUF blocks kept packed) against `panel_linear` on bfloat16.

One decode step's linears of SmolLM2-135M (30 layers of q, k, v, o, gate, up, down: 576 wide,
1536 intermediate; no head), each weight a different tensor so the step streams them all from
memory, as a decode step does. For each row count (`--rows`), rounds alternate between bfloat16
panels (`panel_linear`, what ArborLM's bf16 decode runs) and each packed type (weights from
`gguf`'s quantizer on random values), `--repeats` rounds; prints the median and the fastest
round of each, in milliseconds per step, and bf16 / type (above 1: the packed type is faster).
Activations are bfloat16 in both.

    python benchmarks/quant_linear.py [--threads 2] [--repeats 7] [--rows 1 8 32 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from gguf import GGMLQuantizationType as T

from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.quant_linear import quantize_weight

LAYERS = 30
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
TYPES = [T.Q8_0, T.Q5_0, T.Q4_1, T.Q4_0]


def weights(kind: str | T) -> list[tuple]:
    """One step's weights: (packed tensor, out, in) per linear."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for rows, cols in SHAPES:
            w = torch.randn(rows, cols, generator=g) * 0.02
            packed = cpu_kernels.pack_panels(w.bfloat16()) if kind == "bf16" \
                else quantize_weight(w, kind)
            out.append((packed, rows, cols))
    return out


def step(kind: str | T, layers: list[tuple], xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for packed, rows, cols in layers:
        if kind == "bf16":
            cpu_kernels.panel_linear(xs[cols], packed, rows)
        else:
            cpu_kernels.quant_linear(xs[cols], packed, int(kind))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    args = ap.parse_args()
    if not cpu_kernels.available(torch.bfloat16):
        raise SystemExit("this CPU lacks AVX512-BF16: no bfloat16 panels to compare with")
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, quant_linear path: {cpu_kernels.quant_path()}, "
          f"VNNI: {capabilities.has_avx512_vnni()}")
    kinds: list[str | T] = ["bf16", *TYPES]
    sets = {kind: weights(kind) for kind in kinds}
    for rows in args.rows:
        g = torch.Generator().manual_seed(rows)
        xs = {cols: torch.randn(rows, cols, generator=g).bfloat16() for cols in (576, 1536)}
        times: dict[str | T, list[float]] = {kind: [] for kind in kinds}
        for kind in kinds:  # warm-up
            step(kind, sets[kind], xs)
        for _ in range(args.repeats):
            for kind in kinds:
                times[kind].append(step(kind, sets[kind], xs))
        base = statistics.median(times["bf16"])
        for kind in kinds:
            name = kind if isinstance(kind, str) else kind.name
            med, best = statistics.median(times[kind]), min(times[kind])
            print(f"rows {rows:4d}  {name:5s} median {med * 1e3:8.2f} ms  fastest "
                  f"{best * 1e3:8.2f} ms  bf16/this {base / med:5.2f}")


if __name__ == "__main__":
    main()

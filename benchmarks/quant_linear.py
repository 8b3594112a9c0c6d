"""`quant_linear` (linears from GGUF blocks kept packed) against the float linears ArborLM runs.

One decode step's linears of SmolLM2-135M (30 layers of q, k, v, o, gate, up, down: 576 wide,
1536 intermediate; no head), or with `--model 125M` of the random 125M Llama that
`real_model.py --random-q4-0` quantizes (12 layers, 768 wide, 2048 intermediate, q/k/v and
gate/up stacked as the engine stacks them; `--head` adds its 32,000 x 768 output head, which
that model's q4_0 quantizes to Q6_K), each weight a different tensor so the step streams them
all from memory, as a decode step does. For each row count (`--rows`), rounds alternate between
bfloat16 panels (`panel_linear`, what ArborLM's bf16 decode runs) and each packed type (weights from
`gguf`'s quantizer on random values) on each of `quant_linear`'s paths (`--paths`: "float",
weights dequantized in registers against activations widened to float32; "bf16", against the
bfloat16 activations with `vdpbf16ps`; "vnni2", activations in two int8 terms; "vnni", int8
activations; "amx", weights dequantized to bfloat16 a chunk at a time, then oneDNN's GEMM (AMX
tiles); "avx2_int", "vnni2" with AVX2's byte products, and "avx2", blocks dequantized to
float32 in 8-lane FMAs, where AVX-512 is missing;
"portable", scalar; "default", `quant_path`'s choice for the row count),
`--repeats` rounds; prints the median and the fastest round of each, in milliseconds per step,
and base / this (above 1: the packed one is faster). Activations are bfloat16 throughout.
On a CPU without AVX512-BF16 the base is what the engine runs there instead: float32 weights in
`PackedLinear` (oneDNN) on float32 activations, which the packed paths then take too.

    python benchmarks/quant_linear.py [--threads 2] [--repeats 7] [--rows 1 8 32 128 512]
        [--model SmolLM2|125M] [--head]
        [--types Q8_0 Q4_1] [--paths default float bf16 vnni2 vnni amx avx2_int avx2 portable]
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
from arborlm.runtime.platforms.cpu.linear import PackedLinear
from arborlm.runtime.platforms.cpu.quant_loading import quantize_weight

# (layers, the linears of one layer as (out, in)) per model.
MODELS = {
    "SmolLM2": (30, [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
                     (576, 1536)]),
    "125M": (12, [(1280, 768), (768, 768), (4096, 768), (768, 2048)]),
}
HEAD = (32000, 768)  # the 125M Llama's vocabulary x hidden
TYPES = ["Q8_0", "Q4_1"]
PATHS = ["default", "float", "bf16", "vnni2", "vnni", "amx", "avx2_int", "avx2", "portable"]


def weights(kind: str | T, shapes: list[tuple[int, int]], head: bool) -> list[tuple]:
    """One step's weights, (packed tensor, out, in, GGUF type or None) per linear: `shapes`,
    then with `head` the output head (Q6_K for a quantized `kind`, as `quantize_model` makes
    a q4_0 model's)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (rows, cols) in enumerate(shapes + ([HEAD] if head else [])):
        qtype = None if kind in ("bf16", "fp32") else T.Q6_K if i == len(shapes) else kind
        w = torch.randn(rows, cols, generator=g) * 0.02
        if kind == "bf16":
            packed = cpu_kernels.pack_panels(w.bfloat16())
        elif kind == "fp32":  # the engine's float32 linear where there are no panels
            linear = torch.nn.Linear(cols, rows, bias=False).requires_grad_(False)
            linear.weight.copy_(w)
            packed = PackedLinear(linear)
        else:
            packed = quantize_weight(w, qtype)
        out.append((packed, rows, cols, qtype))
    return out


def step(kind: str | tuple[T, str], layers: list[tuple], xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    if kind == "bf16":
        for packed, rows, cols, _ in layers:
            cpu_kernels.panel_linear(xs[cols], packed, rows)
    elif kind == "fp32":
        for module, _, cols, _ in layers:
            module(xs[cols])
    else:
        path = None if kind[1] == "default" else kind[1]
        for packed, _, cols, qtype in layers:
            cpu_kernels.quant_linear(xs[cols], packed, int(qtype), path=path)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--types", nargs="+", default=TYPES, choices=[t.name for t in T])
    ap.add_argument("--paths", nargs="+", default=PATHS, choices=PATHS)
    ap.add_argument("--model", choices=list(MODELS), default="SmolLM2")
    ap.add_argument("--head", action="store_true",
                    help="with --model 125M: the output head too (Q6_K on the packed sides)")
    args = ap.parse_args()
    if args.head and args.model != "125M":
        ap.error("--head: only with --model 125M (SmolLM2's head is the embedding's Q8_0 table)")
    n_layers, layer = MODELS[args.model]
    shapes = layer * n_layers
    base = "bf16" if cpu_kernels.available(torch.bfloat16) else "fp32"
    act = torch.bfloat16 if base == "bf16" else torch.float32
    torch.set_num_threads(args.threads)
    here = cpu_kernels.quant_paths()
    print(f"threads {args.threads}, quant_linear paths here: {', '.join(here)}, "
          f"AVX512-BF16: {capabilities.has_native_bf16()}")
    types = [T[name] for name in args.types]
    sets = {kind: weights(kind, shapes, args.head) for kind in [base, *types]}
    widths = sorted({cols for _, cols in shapes})
    kinds: list = [base] + [(t, p) for t in types for p in args.paths
                            if p == "default" or p in here]
    for rows in args.rows:
        g = torch.Generator().manual_seed(rows)
        xs = {cols: torch.randn(rows, cols, generator=g).to(act) for cols in widths}
        times: dict = {kind: [] for kind in kinds}

        def layers(kind):
            return sets[kind if kind == base else kind[0]]

        for kind in kinds:  # warm-up
            step(kind, layers(kind), xs)
        for _ in range(args.repeats):
            for kind in kinds:
                times[kind].append(step(kind, layers(kind), xs))
        base_s = statistics.median(times[base])
        for kind in kinds:
            if kind == base:
                name = "bf16 panels" if base == "bf16" else "fp32 PackedLinear"
            else:
                chosen = cpu_kernels.quant_path(rows) if kind[1] == "default" else kind[1]
                name = f"{kind[0].name} {kind[1]}" + (f" ({chosen})" if kind[1] == "default"
                                                      else "")
            med, best = statistics.median(times[kind]), min(times[kind])
            print(f"rows {rows:4d}  {name:24s} median {med * 1e3:8.2f} ms  fastest "
                  f"{best * 1e3:8.2f} ms  base/this {base_s / med:5.2f}", flush=True)


if __name__ == "__main__":
    main()

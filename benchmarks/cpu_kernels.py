"""ArborLM's own CPU kernels against the library calls they replace, on the 32M benchmark model's
shapes, in one run.

Each row times ArborLM's kernel and its peer alternately (`--repeats` rounds of `--calls` calls
each) and prints both medians and the peer/ours ratio (above 1: ours is faster):

  panel_linear     one step's linears (8 layers: qkv, o, gate_up, down; the head), each weight
                   read once per step (no cache reuse between calls), for 1 row against
                   `F.linear` (MKL / oneDNN GEMV) and for 32 rows against oneDNN's packed
                   weight (`mkldnn::_linear_pointwise`, what decode batches called before)
  huge pages       the same one-row panel stream with the weights on transparent huge pages
                   (`HugePageArena`) against torch's own allocations
  decode attention batch 32, 8 heads over 4 KV heads, ~96 of 192 keys per request (the decode
                   workspace's padded layout): `decode_attention` against two batched matmuls
                   around a float32 softmax (the path it replaced)
  paged attention  one decode step's attention over the paged pool: 32 requests x 96 keys, 8
                   layers' pools (50 MB of float32 keys and values: read from memory, not
                   cache), slots interleaved as decode hands them out: `decode_attention_paged`
                   against gathering the keys (`index_select`) and the bmm path above
  causal attention a 512-token prompt's attention, 8 heads over 4 KV heads (one layer):
                   `causal_attention` against `scaled_dot_product_attention(is_causal=True)`
                   (ATen's CPU flash kernel, what prefill called before)
  add_rms_norm     a 512-token prefill's residual add + RMSNorm, float32: one pass against
                   `residual.add_(x)` + `F.rms_norm`
  silu_and_mul     a 512-token prefill's SwiGLU, float32: one pass against `F.silu(g) * u`
  argmax_rows      greedy sampling of 32 rows of 8,192 (32M) and 32,000 (125M) logits:
                   `argmax_rows` against `torch.argmax`
  packed_linear    a 32-row linear through its packed oneDNN weight (512 x 512, float32):
                   ArborLM's C++ operator against the same call as a Python custom op (what a
                   compiled batch step calls; eager here, so the gap is a lower bound)

    python benchmarks/cpu_kernels.py [--threads 2] [--repeats 7]

CPUs without AVX-512 have none of these kernels; the script says so and stops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from arborlm.runtime.platforms.cpu import huge_pages  # noqa: E402
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels  # noqa: E402
from arborlm.runtime.platforms.cpu import linear as cpu_linear  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 512, 1408, 8, 8192, 8, 4, 64
LINEARS = [(3 * HIDDEN // 2 + HIDDEN // 2, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN),
           (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]  # (out, in); qkv = 512 + 2 * 256


def timed(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of `calls` back-to-back calls."""
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def compare(ours: Callable[[], object], peer: Callable[[], object], repeats: int,
            calls: int) -> tuple[float, float, float]:
    """(our median, the peer's median, median of peer/ours per round), seconds; alternating."""
    for fn in (ours, peer):
        timed(fn, max(2, calls // 4))  # warm-up
    a, p = [], []
    for _ in range(repeats):
        a.append(timed(ours, calls))
        p.append(timed(peer, calls))
    return statistics.median(a), statistics.median(p), statistics.median(
        y / x for x, y in zip(a, p))


def panel_rows(dtype: torch.dtype, repeats: int, calls: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(dtype) * 0.02 for o, i in LINEARS]
    panels = [cpu_kernels.pack_panels(w) for w in weights]
    mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
    flop = 2 * 32 * sum(w.numel() for w in weights)
    name = str(dtype).removeprefix("torch.")
    rows = []

    def ours(ps: list[torch.Tensor], n: int) -> Callable[[], object]:
        xs = [torch.randn(n, i, generator=gen).to(dtype) for _, i in LINEARS]
        return lambda: [cpu_kernels.panel_linear(x, p, o) for x, p, (o, _) in zip(xs, ps, LINEARS)]

    xs = [torch.randn(1, i, generator=gen).to(dtype) for _, i in LINEARS]
    a, p, r = compare(ours(panels, 1), lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
                      repeats, calls)
    rows.append(("panel_linear, 1 row", name, f"{mb:.0f} MB",
                 f"{a * 1e3:.2f} ms ({mb / 1e3 / a:.0f} GB/s)",
                 f"F.linear {p * 1e3:.2f} ms", f"{r:.2f}x"))
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    xs = [torch.randn(32, i, generator=gen).to(dtype) for _, i in LINEARS]
    a, p, r = compare(ours(panels, 32), lambda: [
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for x, w in zip(xs, packed)],
        repeats, max(2, calls // 8))
    rows.append(("panel_linear, 32 rows", name, f"{mb:.0f} MB",
                 f"{a * 1e3:.2f} ms ({flop / 1e9 / a:.0f} GFLOP/s)",
                 f"oneDNN packed {p * 1e3:.2f} ms ({flop / 1e9 / p:.0f})", f"{r:.2f}x"))
    if huge_pages.huge_pages_possible():
        arena = huge_pages.HugePageArena(sum(-(-q.numel() * q.element_size() // 64) * 64
                                             for q in panels))
        on_huge = [arena.copy(q) for q in panels]
        a, p, r = compare(ours(on_huge, 1), ours(panels, 1), repeats, calls)
        rows.append(("huge pages, 1 row", name, f"{mb:.0f} MB",
                     f"{a * 1e3:.2f} ms ({mb / 1e3 / a:.0f} GB/s)",
                     f"4 KiB pages {p * 1e3:.2f} ms", f"{r:.2f}x"))
    return rows


def attention_row(dtype: torch.dtype, repeats: int, calls: int) -> tuple:
    bsz, keys, cap, group = 32, 96, 192, HEADS // KV_HEADS
    gen = torch.Generator().manual_seed(1)
    kbuf = torch.randn(KV_HEADS * bsz, cap, HEAD_DIM, generator=gen).to(dtype)
    vbuf = torch.randn(KV_HEADS * bsz, cap, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(KV_HEADS * bsz, group, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.full((bsz,), keys)
    mask = torch.zeros(1, bsz, 1, cap)
    mask[..., keys:] = float("-inf")
    scale = HEAD_DIM ** -0.5
    # The matmul path's width: float32 reads the longest row (a strided view is fastest there),
    # bfloat16 the whole capacity (its batched matmuls want a contiguous operand).
    width = keys if dtype == torch.float32 else cap

    def matmuls() -> torch.Tensor:
        k, v = kbuf[:, :width], vbuf[:, :width]
        s = torch.bmm(q, k.transpose(1, 2)).float().view(KV_HEADS, bsz, group, width)
        s = s.mul_(scale).add_(mask[..., :width])
        probs = torch.softmax(s, dim=-1).to(dtype).view(-1, group, width)
        return torch.bmm(probs, v)

    a, p, r = compare(lambda: cpu_kernels.decode_attention(q, kbuf[:, :keys], vbuf[:, :keys],
                                                            lens, scale),
                      matmuls, repeats, calls)
    return ("decode attention", str(dtype).removeprefix("torch."), "B=32, 96/192 keys",
            f"{a * 1e6:.0f} us", f"bmm-softmax-bmm {p * 1e6:.0f} us", f"{r:.2f}x")


def paged_row(dtype: torch.dtype, repeats: int, calls: int) -> tuple:
    bsz, keys, prompt, slots_per_layer = 32, 96, 32, 16384
    gen = torch.Generator().manual_seed(2)
    pools = [(torch.randn(slots_per_layer, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
              torch.randn(slots_per_layer, KV_HEADS, HEAD_DIM, generator=gen).to(dtype))
             for _ in range(LAYERS)]
    q = torch.randn(bsz, HEADS, HEAD_DIM, generator=gen).to(dtype)
    # Each prompt's slots together, then one slot per request per decode step.
    slots = torch.cat([torch.arange(bsz)[:, None] * prompt + torch.arange(prompt)[None],
                       bsz * prompt + torch.arange(keys - prompt)[None] * bsz
                       + torch.arange(bsz)[:, None]], dim=1)
    lens = torch.full((bsz,), keys)
    scale, group = HEAD_DIM ** -0.5, HEADS // KV_HEADS

    def ours() -> None:
        for k, v in pools:
            cpu_kernels.decode_attention_paged(q, k, v, slots, lens, scale)

    def gathered() -> None:
        qh = q.view(bsz * KV_HEADS, group, HEAD_DIM)  # (request, KV head) rows, as above
        for k, v in pools:
            kg = k.index_select(0, slots.view(-1)).view(bsz, keys, KV_HEADS, HEAD_DIM)
            vg = v.index_select(0, slots.view(-1)).view(bsz, keys, KV_HEADS, HEAD_DIM)
            kg = kg.transpose(1, 2).reshape(bsz * KV_HEADS, keys, HEAD_DIM)
            vg = vg.transpose(1, 2).reshape(bsz * KV_HEADS, keys, HEAD_DIM)
            s = torch.bmm(qh, kg.transpose(1, 2)).float().mul_(scale)
            torch.bmm(torch.softmax(s, dim=-1).to(dtype), vg)

    a, p, r = compare(ours, gathered, repeats, calls)
    mb = 2 * LAYERS * bsz * keys * KV_HEADS * HEAD_DIM * pools[0][0].element_size() / 1e6
    return ("paged attention", str(dtype).removeprefix("torch."), f"B=32, 96 keys, {LAYERS} layers",
            f"{a * 1e3:.2f} ms ({mb / 1e3 / a:.0f} GB/s)", f"gather + bmm {p * 1e3:.2f} ms",
            f"{r:.2f}x")


def causal_row(dtype: torch.dtype, repeats: int, calls: int, tokens: int = 512) -> tuple:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM ** -0.5
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    a, p, r = compare(lambda: cpu_kernels.causal_attention(q, k, v, scale),
                      lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                             scale=scale, enable_gqa=True),
                      repeats, calls)
    flops = 4 * HEADS * HEAD_DIM * tokens * (tokens + 1) / 2
    return ("causal attention", str(dtype).removeprefix("torch."), f"{tokens} tokens",
            f"{a * 1e3:.2f} ms ({flops / a / 1e9:.0f} GFLOP/s)",
            f"SDPA {p * 1e3:.2f} ms ({flops / p / 1e9:.0f})", f"{r:.2f}x")


def elementwise_rows(repeats: int, calls: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(512, HIDDEN, generator=gen)
    residual = torch.randn(512, HIDDEN, generator=gen)
    w = torch.randn(HIDDEN, generator=gen)
    gate_up = torch.randn(512, 2 * INTER, generator=gen)

    def norm_peer() -> torch.Tensor:
        residual.add_(x)
        return F.rms_norm(residual, (HIDDEN,), w, 1e-6)

    a, p, r = compare(lambda: cpu_kernels.add_rms_norm(x, residual, w, 1e-6), norm_peer,
                      repeats, calls)
    rows = [("add_rms_norm", "float32", "512 x 512", f"{a * 1e6:.0f} us",
             f"add_ + F.rms_norm {p * 1e6:.0f} us", f"{r:.2f}x")]
    a, p, r = compare(lambda: cpu_kernels.silu_and_mul(gate_up),
                      lambda: F.silu(gate_up[:, :INTER]).mul_(gate_up[:, INTER:]), repeats, calls)
    rows.append(("silu_and_mul", "float32", "512 x 2816", f"{a * 1e6:.0f} us",
                 f"F.silu * up {p * 1e6:.0f} us", f"{r:.2f}x"))
    return rows


def argmax_rows(repeats: int, calls: int) -> list[tuple]:
    rows = []
    for vocab in (VOCAB, 32000):
        logits = torch.randn(32, vocab, generator=torch.Generator().manual_seed(3))
        a, p, r = compare(lambda x=logits: cpu_kernels.argmax_rows(x),
                          lambda x=logits: torch.argmax(x, dim=-1), repeats, calls)
        rows.append(("argmax_rows", "float32", f"32 x {vocab}", f"{a * 1e6:.0f} us",
                     f"torch.argmax {p * 1e6:.0f} us", f"{r:.2f}x"))
    return rows


def packed_linear_row(repeats: int, calls: int) -> tuple | None:
    if not (cpu_linear.packing_available() and cpu_kernels.packed_linear_available()):
        return None
    layer = cpu_linear.PackedLinear(torch.nn.Linear(HIDDEN, HIDDEN, bias=False))
    x = torch.randn(32, HIDDEN)
    a, p, r = compare(lambda: cpu_linear.packed_linear(x, layer.handle),
                      lambda: cpu_linear.packed_linear_py(x, layer.handle), repeats, calls * 5)
    return ("packed_linear", "float32", "32 x 512 x 512", f"{a * 1e6:.1f} us",
            f"Python custom op {p * 1e6:.1f} us", f"{r:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=40, help="calls per timed round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available(torch.float32):
        print("ArborLM's CPU kernels do not run here (they need x86-64 with AVX-512)")
        return
    rows = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            if cpu_kernels.available(dtype):
                rows += panel_rows(dtype, args.repeats, args.calls)
            rows.append(attention_row(dtype, args.repeats, args.calls))
            rows.append(paged_row(dtype, args.repeats, max(1, args.calls // 4)))
            rows.append(causal_row(dtype, args.repeats, max(1, args.calls // 4)))
        rows += elementwise_rows(args.repeats, args.calls)
        rows += argmax_rows(args.repeats, args.calls)
        packed = packed_linear_row(args.repeats, args.calls)
        rows += [packed] if packed else []
    print(f"threads {args.threads}; medians of {args.repeats} alternating rounds of "
          f"{args.calls} calls; ratio = peer / ArborLM")
    print(table(rows, ("kernel", "dtype", "shape", "ArborLM", "peer", "ratio")))


if __name__ == "__main__":
    main()

"""The cost of a speculative verify step on the default model: eager extend against decode rows.

One request with `--context` tokens of KV; a verify of n tokens (the newest one and n - 1
drafts) run two ways through the engine's `ModelRunner`: as an eager EXTEND of n tokens (how
verify steps ran before), and as a DECODE of n rows over the request's one `req_to_token` row
(`ScheduledBatch._verify_rows`, how they run now). Both ways alternate, `--iters` times each;
the table gives the 10th-percentile milliseconds (the machine is shared: the low end is the
least disturbed) and each against one decode row (a plain decode step). It also checks that
both ways give the same logits.

    python benchmarks/verify_step.py [--context 200] [--iters 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table  # noqa: E402

SIZES = (1, 2, 3, 5, 9, 17)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args()
    from arborlm.runtime.config import EngineArgs
    from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
    from arborlm.runtime.model_runner import ModelRunner

    ctx = args.context
    runner = ModelRunner(EngineArgs(max_total_tokens=ctx + 64).resolve())
    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc_slots(ctx + max(SIZES))
    runner.req_to_token_pool.write(row, 0, slots)
    gen = torch.Generator().manual_seed(0)

    def batch(start: int, n: int, rows: bool, ids: torch.Tensor | None = None) -> ForwardBatch:
        ids = torch.randint(100, 1000, (n,), generator=gen) if ids is None else ids
        lens = list(range(start + 1, start + n + 1)) if rows else [start + n]
        return ForwardBatch(
            mode=ForwardMode.DECODE if rows else ForwardMode.EXTEND,
            batch_size=n if rows else 1, input_ids=ids, positions=torch.arange(start, start + n),
            req_pool_indices=torch.tensor([row] * (n if rows else 1)),
            seq_lens=torch.tensor(lens), out_cache_loc=slots[start:start + n],
            req_to_token_pool=runner.req_to_token_pool, kv_pool=runner.kv_pool,
            seq_lens_cpu=lens, extend_prefix_lens_cpu=[] if rows else [start],
            extend_seq_lens_cpu=[] if rows else [n],
            logits_indices=None if rows else torch.arange(n))

    runner.forward(batch(0, ctx, rows=False))
    ids = torch.randint(100, 1000, (5,), generator=gen)
    diff = (runner.forward(batch(ctx, 5, False, ids)) - runner.forward(batch(ctx, 5, True, ids)))
    times: dict[tuple[int, bool], list[float]] = {(n, r): [] for n in SIZES for r in (False, True)}
    for _ in range(args.iters):
        for key in times:
            b = batch(ctx, *key)
            start = time.perf_counter()
            runner.forward(b)
            times[key].append(time.perf_counter() - start)

    def p10(key: tuple[int, bool]) -> float:
        return sorted(times[key])[len(times[key]) // 10] * 1000

    one = p10((1, True))
    rows = [(n, f"{p10((n, False)):.1f}", f"{p10((n, True)):.1f}",
             f"{p10((n, False)) / one:.2f}x", f"{p10((n, True)) / one:.2f}x") for n in SIZES]
    print(f"decode executor {type(runner.decode).__name__}, {runner.config.model.dtype}, "
          f"context {ctx}; max |logits extend - rows| = {float(diff.abs().max()):.3g}")
    print(table(rows, ("tokens", "extend ms", "rows ms", "extend / decode", "rows / decode")))


if __name__ == "__main__":
    main()

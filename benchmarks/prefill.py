"""Prefill (time to first token) of the default model: bfloat16 on oneDNN against the panels.

`PackedLinear` gives a call of more than `linear.panel_max_rows(dtype)` rows to oneDNN and
fewer to ArborLM's panel kernel. Where oneDNN runs bfloat16 on AMX tiles the limit is
`AMX_PANEL_MAX_ROWS`; elsewhere `PANEL_MAX_ROWS`. Deterministic inference (the bfloat16 default
where the kernels run) keeps every linear on the panels, whose sums do not depend on the number
of rows, so the limit applies with `enable_deterministic_inference=False`. This loads the
default model three times in one process: deterministic; not, with `PANEL_MAX_ROWS`; not, with
this CPU's limit (`--panel-rows`: default `panel_max_rows(bfloat16)`). It times one request of
each prompt length (`--lengths`) with `max_new_tokens` 1 on each, in turn, `--repeats` times
after a warm-up, the prefix cache flushed before each, and prints the median milliseconds of
each and the last against the others.

    python benchmarks/prefill.py [--lengths 16 94 256 512] [--repeats 5] [--panel-rows 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table  # noqa: E402

TEXT = ("The history of the lighthouse begins in antiquity, when fires on hilltops guided ships "
        "past rocks and into harbours. ")


def _engine(rows: int, deterministic: bool):
    from arborlm import Engine
    from arborlm.runtime.platforms.cpu import linear

    saved = linear.PANEL_MAX_ROWS, linear.AMX_PANEL_MAX_ROWS
    linear.PANEL_MAX_ROWS = linear.AMX_PANEL_MAX_ROWS = rows  # read when the layers are built
    try:
        return Engine(enable_deterministic_inference=deterministic)
    finally:
        linear.PANEL_MAX_ROWS, linear.AMX_PANEL_MAX_ROWS = saved


def main() -> None:
    from arborlm.runtime.platforms.cpu import linear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 94, 256, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--panel-rows", type=int,
                    default=linear.panel_max_rows(torch.bfloat16))
    args = ap.parse_args()
    from arborlm.runtime.platforms.cpu import capabilities

    engines = {
        "deterministic": _engine(linear.PANEL_MAX_ROWS, True),
        f"panels to {linear.PANEL_MAX_ROWS} rows": _engine(linear.PANEL_MAX_ROWS, False),
        f"panels to {args.panel_rows} rows": _engine(args.panel_rows, False),
    }
    print(f"AMX bfloat16 here: {capabilities.has_amx_bf16()}")
    ids_all = next(iter(engines.values())).tokenizer.encode(TEXT * 64, add_special_tokens=False)
    rows = []
    try:
        for n in args.lengths:
            ids = ids_all[:n]
            params = {"temperature": 0, "max_new_tokens": 1}
            times: dict[str, list[float]] = {k: [] for k in engines}
            for i in range(args.repeats + 1):
                for k, engine in engines.items():
                    engine.flush_cache()
                    start = time.perf_counter()
                    engine.generate(input_ids=ids, sampling_params=params)
                    if i:
                        times[k].append(time.perf_counter() - start)
            med = [statistics.median(times[k]) for k in engines]
            rows.append((n, *(f"{m * 1e3:.1f}" for m in med),
                         f"{med[0] / med[2]:.2f}x", f"{med[1] / med[2]:.2f}x"))
    finally:
        for engine in engines.values():
            engine.shutdown()
    names = list(engines)
    print(table(rows, ("prompt tokens", *(f"ms, {k}" for k in names), f"vs {names[0]}",
                       f"vs {names[1]}")))


if __name__ == "__main__":
    main()

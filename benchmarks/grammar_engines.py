"""Grammar engines side by side: compile rate and time, per-token mask time, masking kernels.

Over a seeded sample of shared/data/jsonschemabench-dev.jsonl and the default model's 32,000-
token vocabulary, for xgrammar and outlines-core through ArborLM's backends (schema check,
rewrites and all); torch on one thread, xgrammar compiling with up to 4 of its own:

1. compile: how many schemas each backend compiles, refuses (keywords it would drop, or the
   engine's own error) or times out on; compile time median and p90 over the compiled ones;
2. mask: time of `fill_bitmask` per generated token (median, p99), sampling up to
   `--tokens` tokens per compiled schema from seeded noise;
3. apply: cost of masking the logits with real masks gathered in (2) for the first backend,
   batch 1 and 32, for xgrammar's CPU kernel, the numpy unpack path, a plain torch unpack,
   ArborLM's C++ kernel (`cpu_kernels.apply_token_bitmask`, where the operators build) and
   `apply_token_bitmask_` (what the decode loop calls: the C++ kernel there, else numpy, plus
   its argument handling).

    python benchmarks/grammar_engines.py                   # 60 schemas, both backends
    python benchmarks/grammar_engines.py --n 300 --timeout 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import table  # noqa: E402

from arborlm.constrained import create_grammar_backend  # noqa: E402
from arborlm.constrained.base import GrammarBackend  # noqa: E402
from arborlm.constrained.bitmask import (  # noqa: E402
    _apply_numpy,
    allocate_token_bitmask,
    apply_token_bitmask_,
)
from arborlm.constrained.compile_cache import GrammarCompiler  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench-dev.jsonl"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def load_schemas(n: int, seed: int) -> list[dict]:
    rows = [json.loads(line) for line in BENCH.read_text().splitlines()]
    return random.Random(seed).sample(rows, min(n, len(rows)))


def compile_all(backend: GrammarBackend, rows: list[dict]) -> tuple[list, dict, list[float]]:
    """Compile one schema at a time (timed from submit to result) under the time limit."""
    compiler = GrammarCompiler({backend.name: backend}, backend.name, max_workers=1,
                               max_stalled=len(rows))
    grammars, outcome, times = [], {"compiled": 0, "refused": 0, "timed out": 0}, []
    for row in rows:
        start = time.perf_counter()
        future = compiler.submit("json_schema", json.dumps(row["schema"]))
        error = future.exception()
        elapsed = time.perf_counter() - start
        if error is None:
            grammars.append(future.result())
            outcome["compiled"] += 1
            times.append(elapsed)
        else:
            outcome["timed out" if "timed out" in str(error) else "refused"] += 1
    return grammars, outcome, times


def mask_times(backend: GrammarBackend, grammars: list, tokens: int,
               keep: list[torch.Tensor]) -> list[float]:
    """Per-token fill_bitmask times (s) while sampling; some filled masks go into `keep`."""
    vocab = backend.vocab_size
    bias = torch.zeros(vocab)  # [V]: a pull towards closing characters, so outputs finish
    for token_id, text in enumerate(backend.vocab.decoded):
        bias[token_id] = 2.0 if any(c in text for c in b'"]},') else 0.0
    times: list[float] = []
    mask = allocate_token_bitmask(1, vocab)  # [1, W]
    gen = torch.Generator().manual_seed(0)
    for grammar in grammars:
        matcher = grammar.matcher()
        for step in range(tokens):
            start = time.perf_counter()
            matcher.fill_bitmask(mask, 0)
            times.append(time.perf_counter() - start)
            if step % 8 == 0:
                keep.append(mask[0].clone())
            logits = torch.randn(1, vocab, generator=gen) + bias * (step / 16)  # [1, V]
            apply_token_bitmask_(logits, mask)
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if not matcher.accept_token(token) or matcher.is_terminated():
                break
    return times


def torch_unpack_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The naive path: unpack every bit with torch ops, then masked_fill."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [B, W*32]
    logits.masked_fill_(~bits[:, :logits.shape[1]], float("-inf"))


def apply_rows(masks: list[torch.Tensor], vocab: int) -> list[tuple]:
    import xgrammar as xgr

    kernels = {
        "xgrammar cpu kernel": lambda lg, bm: xgr.apply_token_bitmask_inplace(
            lg, bm, backend="cpu"),
        "numpy unpack": lambda lg, bm: _apply_numpy(lg, bm, list(range(lg.shape[0])), vocab),
        "torch unpack": torch_unpack_apply,
        "apply_token_bitmask_ (ArborLM)": apply_token_bitmask_,
    }
    from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

    if cpu_kernels.token_bitmask_available():
        kernels["C++ kernel (ArborLM)"] = lambda lg, bm: cpu_kernels.apply_token_bitmask(
            lg, bm, list(range(lg.shape[0])), vocab)
    rng = random.Random(0)
    rows = []
    for batch in (1, 32):
        batches = [torch.stack(rng.sample(masks, batch)) for _ in range(50)]  # [B, W] each
        logits = torch.randn(batch, vocab)
        for name, kernel in kernels.items():
            samples = []
            for bm in batches:
                work = logits.clone()
                start = time.perf_counter()
                kernel(work, bm)
                samples.append(time.perf_counter() - start)
            rows.append((name, batch, f"{statistics.median(samples) * 1e6:.0f}",
                         f"{percentile(samples, 99) * 1e6:.0f}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=60, help="schemas sampled from the bench")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0, help="compile time limit (s)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens sampled per schema")
    parser.add_argument("--backends", default="xgrammar,outlines")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoTokenizer

    from arborlm.runtime.config import ModelConfig
    from arborlm.runtime.models.factory import default_model_path

    path = default_model_path()
    config = ModelConfig.from_path(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    rows = load_schemas(args.n, args.seed)
    print(f"{len(rows)} JSONSchemaBench schemas (seed {args.seed}), vocabulary "
          f"{config.vocab_size}, compile limit {args.timeout:g} s, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    compile_table, mask_table, masks, apply_table = [], [], [], []
    for name in args.backends.split(","):
        start = time.perf_counter()
        backend = create_grammar_backend(name, tokenizer, config.vocab_size,
                                         list(config.eos_token_ids) or [2],
                                         compile_timeout_s=args.timeout)
        setup = time.perf_counter() - start
        grammars, outcome, times = compile_all(backend, rows)
        compile_table.append((
            name, f"{setup:.2f}", f"{outcome['compiled']}/{len(rows)}", outcome["refused"],
            outcome["timed out"], f"{percentile(times, 50) * 1e3:.1f}",
            f"{percentile(times, 90) * 1e3:.1f}"))
        per_token = mask_times(backend, grammars, args.tokens, masks)
        mask_table.append((name, len(per_token), f"{percentile(per_token, 50) * 1e6:.1f}",
                           f"{percentile(per_token, 99) * 1e6:.1f}"))
        if not apply_table and masks:  # before the next engine's abandoned compiles run
            apply_table = apply_rows(masks, config.vocab_size)
    print("compile (refused = keywords the backend would drop, or an engine error)")
    print(table(compile_table, ("backend", "setup s", "compiled", "refused", "timed out",
                                "p50 ms", "p90 ms")))
    print("\nmask: fill_bitmask per token")
    print(table(mask_table, ("backend", "tokens", "p50 us", "p99 us")))
    print(f"\napply: masking {config.vocab_size}-wide float32 logits with real masks")
    print(table(apply_table, ("kernel", "batch", "p50 us", "p99 us")))
    sys.stdout.flush()
    os._exit(0)  # do not wait for compiles abandoned at their time limit


if __name__ == "__main__":
    main()

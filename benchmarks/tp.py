"""Tensor parallelism on this machine: TP=2 against TP=1, tokens/s (reported, no target).

One in-process engine per configuration on the built-in random-weight model
(`random-llama-40m`: 8 heads, 4 KV heads) or `--model-path`: TP=1 as it runs by default (the
fused C++ decode step on AVX-512 CPUs), TP=1 with eager decode (what every sharded engine runs,
so the two TP=1 rows separate the cost of the executor from the cost of the ranks), and TP=N.
Each generates `--batch` random prompts of `--prompt-len` tokens, `--new` greedy tokens each,
all submitted at once, after one warm-up call; it reports prefill tokens/s (a batch of prompts
with one new token) and decode output tokens/s. With N ranks on a machine of few cores each
rank runs cores/N threads: on 2 cores TP=2 is not expected to win; the run shows what the
broadcast and the collectives cost.

    python benchmarks/tp.py                       # random-llama-40m, float32, TP=1 vs TP=2
    python benchmarks/tp.py --tp 3 --model-path ~/.cache/arborlm/.../SmolLM2-135M...gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_prompts, table  # noqa: E402


def measure(model: str, dtype: str, prompts: list[list[int]], new: int,
            **options) -> tuple[float, float]:
    """(prefill tokens/s, decode output tokens/s) of one engine configuration."""
    from arborlm import Engine

    engine = Engine(model, dtype=dtype, max_total_tokens=65536, **options)
    try:
        greedy = {"temperature": 0.0, "ignore_eos": True}
        engine.generate(input_ids=prompts[:2], sampling_params={**greedy, "max_new_tokens": 4})
        engine.flush_cache()
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": 1})
        prefill = sum(map(len, prompts)) / (time.perf_counter() - start)
        engine.flush_cache()
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": new})
        decode = len(prompts) * new / (time.perf_counter() - start)
        return prefill, decode
    finally:
        engine.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="random-llama-40m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new", type=int, default=64)
    a = p.parse_args()
    from arborlm.runtime.config import EngineArgs

    config = EngineArgs(model_path=a.model_path, dtype=a.dtype).resolve()
    prompts = random_prompts(a.batch, a.prompt_len, a.prompt_len, config.model.vocab_size,
                             seed=0, avoid=set(config.model.eos_token_ids))
    runs = [("TP=1 (default decode executor)", {}),
            ("TP=1, eager decode", {"disable_fused_decode": True}),
            (f"TP={a.tp}", {"tp_size": a.tp})]
    rows = []
    for name, options in runs:
        prefill, decode = measure(config.model.path, a.dtype, prompts, a.new, **options)
        rows.append((name, f"{prefill:.0f}", f"{decode:.1f}"))
        print(f"{name}: prefill {prefill:.0f} tok/s, decode {decode:.1f} tok/s", flush=True)
    print(f"\n{a.model_path}, {a.dtype}, {a.batch} prompts x {a.prompt_len} tokens, "
          f"{a.new} new tokens each")
    print(table(rows, ("configuration", "prefill tok/s", "decode tok/s")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

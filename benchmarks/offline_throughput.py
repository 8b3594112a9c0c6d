"""Offline throughput: ArborLM's Engine vs transformers' generate on the same model, one run.

Workload: 64 prompts of 32–512 random tokens, 64–128 new tokens each, greedy, ignore_eos.
transformers runs padded static batches (left padding, `--hf-batch` prompts per batch) and is
credited only with each prompt's requested new tokens. Prints output tokens/s of both, the
ratio, the machine's fp32 matmul peak, and the engine's model FLOP/s as a fraction of it.

    python benchmarks/offline_throughput.py            # the default ~30M model
    python benchmarks/offline_throughput.py --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    matmul_peak_gflops,
    model_flops,
    off_main_thread,
    random_prompts,
    table,
)


def workload(vocab: int, specials: set[int], n: int, seed: int = 0):
    prompts = random_prompts(n, 32, 512, vocab, seed=seed, avoid=specials)
    rng = random.Random(seed + 1)
    new = [rng.randint(64, 128) for _ in prompts]
    return prompts, new


def run_engine(engine, prompts, new) -> float:
    params = [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in new]
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - t
    assert [len(o["output_ids"]) for o in outs] == new
    return elapsed


def run_hf(model, prompts, new, batch: int, pad: int) -> float:
    t = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(prompts), batch):
            chunk, steps = prompts[s:s + batch], max(new[s:s + batch])
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="default: the built-in default model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from arborlm import Engine
    from arborlm.runtime.models.factory import default_model_path

    path = args.model_path or str(default_model_path())
    engine = Engine(path, dtype="float32")
    cfg = engine.config.model
    tok = engine.tokenizer
    specials = set(tok.all_special_ids)
    prompts, new = workload(cfg.vocab_size, specials, args.num_prompts)
    total_new = sum(new)
    run_engine(engine, prompts[:4], [8] * 4)  # warm-up

    hf = None
    if not args.skip_hf:
        # transformers runs off the main thread: see `common.off_main_thread`.
        hf = off_main_thread(
            lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        off_main_thread(run_hf, hf, prompts[:2], [4, 4], 2, tok.pad_token_id or 0)
    eng_t, hf_t = [], []
    for _ in range(args.repeats):
        engine.flush_cache()
        eng_t.append(run_engine(engine, prompts, new))
        if hf is not None:
            hf_t.append(off_main_thread(run_hf, hf, prompts, new, args.hf_batch,
                                        tok.pad_token_id or 0))
    eng = statistics.median(eng_t)
    peak = off_main_thread(matmul_peak_gflops)
    flops = model_flops(cfg, [len(p) for p in prompts], new)
    rows = [("arborlm Engine", f"{eng:.2f}", f"{total_new / eng:.1f}",
             f"{flops / eng / 1e9:.1f}", f"{flops / eng / 1e9 / peak:.1%}")]
    if hf_t:
        hft = statistics.median(hf_t)
        rows.append((f"transformers generate (batch {args.hf_batch})", f"{hft:.2f}",
                     f"{total_new / hft:.1f}", f"{flops / hft / 1e9:.1f}",
                     f"{flops / hft / 1e9 / peak:.1%}"))
    print(f"model {path}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab "
          f"{cfg.vocab_size}; {len(prompts)} prompts ({sum(map(len, prompts))} tokens), "
          f"{total_new} new tokens; threads {torch.get_num_threads()}; repeats {args.repeats} "
          f"(medians)")
    print(table(rows, ("runner", "seconds", "output tok/s", "model GFLOP/s", "of fp32 peak")))
    print(f"fp32 matmul peak: {peak:.1f} GFLOP/s")
    if hf_t:
        print(f"ratio arborlm / transformers (output tok/s): {statistics.median(hf_t) / eng:.2f}x")


if __name__ == "__main__":
    main()

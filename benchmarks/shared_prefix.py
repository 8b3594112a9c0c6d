"""Prefix reuse: ArborLM with the radix cache on, off, and transformers, in one run.

(a) 8 groups × 16 requests sharing a 1,024-token system prompt, each with its own 64-token
    question, 32 new tokens, all submitted at once.
(b) multi-turn chat: 16 conversations × 6 turns; each turn's prompt is the previous prompt +
    the answer + a new 64-token message; 32 new tokens per turn.
For each: prefill tokens computed, cache hit rate and its ratio to the workload's optimum, and
end-to-end throughput (output tokens/s) with the cache on, off, and through transformers.

    python benchmarks/shared_prefix.py                 # default model
    python benchmarks/shared_prefix.py --skip-hf       # ArborLM only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import off_main_thread, random_prompts, table  # noqa: E402

NEW = 32


def group_workload(vocab: int, avoid: set[int]) -> tuple[list[list[int]], int]:
    systems = random_prompts(8, 1024, 1024, vocab, seed=1, avoid=avoid)
    questions = random_prompts(128, 64, 64, vocab, seed=2, avoid=avoid)
    prompts = [systems[i // 16] + questions[i] for i in range(128)]
    optimum = 8 * 15 * 1024
    return prompts, optimum


def run_groups(engine, prompts) -> dict:
    s0 = engine.get_server_info()
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW,
                                                               "temperature": 0,
                                                               "ignore_eos": True})
    wall = time.perf_counter() - t
    s1 = engine.get_server_info()
    return {"wall": wall, "out": sum(len(o["output_ids"]) for o in outs),
            "prefill": s1["prefill_tokens"] - s0["prefill_tokens"],
            "cached": sum(o["meta_info"]["cached_tokens"] for o in outs)}


def run_chat(generate, vocab: int, avoid: set[int]) -> dict:
    """`generate(list_of_prompt_ids) -> list of output id lists`; returns totals."""
    msgs = [random_prompts(16, 64, 64, vocab, seed=10 + turn, avoid=avoid) for turn in range(6)]
    prompts = [list(m) for m in msgs[0]]
    optimum = 0
    out_tokens = 0
    t = time.perf_counter()
    for turn in range(6):
        outs = generate(prompts)
        out_tokens += sum(len(o) for o in outs)
        if turn == 5:
            break
        optimum += sum(len(p) + len(o) for p, o in zip(prompts, outs))
        prompts = [p + o + msgs[turn + 1][i] for i, (p, o) in enumerate(zip(prompts, outs))]
    return {"wall": time.perf_counter() - t, "out": out_tokens, "optimum": optimum}


def engine_chat(engine, vocab, avoid) -> dict:
    s0 = engine.get_server_info()
    cached = 0

    def gen(prompts):
        nonlocal cached
        outs = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
        cached += sum(o["meta_info"]["cached_tokens"] for o in outs)
        return [o["output_ids"] for o in outs]

    r = run_chat(gen, vocab, avoid)
    r["prefill"] = engine.get_server_info()["prefill_tokens"] - s0["prefill_tokens"]
    r["cached"] = cached
    return r


def hf_generate(model, pad: int, batch: int = 16):
    def gen(prompts):
        outs = []
        with torch.inference_mode():
            for s in range(0, len(prompts), batch):
                chunk = prompts[s:s + batch]
                width = max(map(len, chunk))
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
                res = model.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False, pad_token_id=pad)
                outs += [r[width:].tolist() for r in res]
        return outs
    return gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    from arborlm import Engine
    from arborlm.runtime.models.factory import default_model_path

    path = args.model_path or str(default_model_path())
    results = {}
    # One engine at a time: two in-process engines keep two OpenMP teams, more OpenMP threads
    # than a small CPU has cores, and libgomp then stops spinning (see `off_main_thread`).
    for name, options in (("cache on", {}), ("cache off", {"disable_radix_cache": True})):
        engine = Engine(path, dtype="float32", **options)
        vocab = engine.config.model.vocab_size
        avoid = set(engine.tokenizer.all_special_ids)
        pad = engine.tokenizer.pad_token_id or 0
        prompts, optimum = group_workload(vocab, avoid)
        engine.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 2})  # warm-up
        engine.flush_cache()
        a = run_groups(engine, prompts)
        engine.flush_cache()
        results[name] = (a, engine_chat(engine, vocab, avoid))
        engine.shutdown()
    total_prompt = sum(map(len, prompts))

    rows = []
    for name, (r, _) in results.items():
        rate = r["cached"] / total_prompt
        rows.append(("(a) groups", name, r["prefill"], f"{rate:.1%}",
                     f"{rate / (optimum / total_prompt):.1%}", f"{r['wall']:.2f}",
                     f"{r['out'] / r['wall']:.1f}"))
    hf_rows = [] if args.skip_hf else off_main_thread(_transformers_rows, path, prompts, pad,
                                                      vocab, avoid, total_prompt)
    rows += hf_rows[:1]
    for name, (_, r) in results.items():
        total = r["prefill"] + r["cached"]
        rate = r["cached"] / total
        rows.append(("(b) chat", name, r["prefill"], f"{rate:.1%}",
                     f"{r['cached'] / r['optimum']:.1%}", f"{r['wall']:.2f}",
                     f"{r['out'] / r['wall']:.1f}"))
    rows += hf_rows[1:]
    print(f"model {path}; threads {torch.get_num_threads()}")
    print(table(rows, ("workload", "runner", "prefill tokens", "hit rate", "of optimum",
                       "seconds", "output tok/s")))
    (a_on, b_on), (a_off, b_off) = results["cache on"], results["cache off"]
    print(f"(a) speed-up cache on vs off: {a_off['wall'] / a_on['wall']:.2f}x; "
          f"(b): {b_off['wall'] / b_on['wall']:.2f}x")


def _transformers_rows(path: str, prompts, pad: int, vocab: int, avoid: set[int],
                       total_prompt: int) -> list[tuple]:
    """The transformers peer's rows for (a) and (b)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = hf_generate(hf, pad)
    t = time.perf_counter()
    gen(prompts)
    wall = time.perf_counter() - t
    rows = [("(a) groups", "transformers", total_prompt, "-", "-", f"{wall:.2f}",
             f"{128 * NEW / wall:.1f}")]
    r = run_chat(hf_generate(hf, pad), vocab, avoid)
    rows.append(("(b) chat", "transformers", "-", "-", "-", f"{r['wall']:.2f}",
                 f"{r['out'] / r['wall']:.1f}"))
    return rows


if __name__ == "__main__":
    main()

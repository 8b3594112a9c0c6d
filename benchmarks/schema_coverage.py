"""JSON-schema coverage on a real model: schemas accepted, outputs finished, outputs valid.

Every schema of JSONSchemaBench's dev sample (`shared/data/jsonschemabench-dev.jsonl` beside the
repository) goes to the engine as one greedy request whose prompt shows the schema (the user turn
of `tests/real_model/test_json_schemas.py`), on three sides, each an engine of its own, one after
the other. The prompt shows the schema compactly (no spaces) and at most `--coverage-schema-tokens`
tokens of it (1,500 by default), cut with a marked truncation: the 500 schemas shown whole hold
1.37M prompt tokens, most of them in a few huge schemas, which no small model reads usefully;
shown this way they hold 347k (128 of the 500 cut).
Only the prompt is cut: the grammar (and the guard) enforce the whole schema, and outputs are
validated against the whole schema.

- `xgrammar alone`: xgrammar compiles the schema as given: no ArborLM checks, rewrites or guard
  (what xgrammar does by itself, keywords it cannot express dropped without a word);
- `outlines-core alone`: the same with outlines-core;
- `ArborLM`: the default pipeline (xgrammar, exact rewrites, the semantic guard, strict mode:
  a schema it cannot guarantee is refused with a 400).

For each side: schemas accepted (the rest refused at compile, or whose prompt does not fit the
context), outputs finished (stopped within `--max-new-tokens`), finished outputs that validate
(`jsonschema`, the schema's own draft), outputs aborted (the guard's dead ends), output tokens
per second over the whole run. Invalid finished outputs are listed with their schema id, so
that each can become a regression test of its cause.

Then the guard's overhead on schemas that need none: the schemas ArborLM compiles without a
guard plan, a sample of `--overhead-schemas`, run by ArborLM and by xgrammar alone alternately
(`--repeats` pairs, engines kept alive), output tokens/s each and the median ratio.

    python benchmarks/constrained.py --coverage-max-new-tokens 256 --coverage-alone-schemas 100
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench-dev.jsonl"
CHUNK = 64  # requests submitted at once
SCHEMA_TOKENS = 1500  # of the schema shown in a prompt (the rest is cut, marked)


@dataclass
class Coverage:
    side: str
    schemas: int = 0
    accepted: int = 0
    too_long: int = 0  # prompt + max_new_tokens past the context: not a schema problem
    finished: int = 0
    valid: int = 0
    aborted: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    invalid: list[tuple[str, str, str]] = field(default_factory=list)

    def row(self) -> tuple:
        counted = self.schemas - self.too_long
        return (self.side, f"{self.accepted}/{counted}", f"{self.finished}/{self.accepted}",
                f"{self.valid}/{self.finished}", self.aborted,
                f"{self.tokens / self.seconds:.0f}" if self.seconds else "-")


HEADER = ("side", "accepted", "finished", "valid", "aborted", "output tok/s")


def load_all(n: int) -> list[tuple[str, dict]]:
    rows = [json.loads(line) for line in BENCH.read_text().splitlines()[:n]]
    return [(row["id"], row["schema"]) for row in rows]


def _validates(schema: Any, text: str) -> tuple[bool, str]:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema)(schema).validate(json.loads(text))
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return False, str(e).splitlines()[0][:160]
    except jsonschema.exceptions._WrappedReferencingError as e:  # remote $ref: unresolvable
        return False, f"unresolvable: {str(e)[:120]}"
    return True, ""


@contextmanager
def engine_alone():
    """The grammar backends compile schemas as given (no checks, rewrites or guard) while
    inside: how xgrammar and outlines-core behave by themselves."""
    from arborlm.constrained import outlines_backend, xgrammar_backend
    from arborlm.constrained.schema_check import parse_schema
    from arborlm.constrained.schema_prepare import PreparedSchema

    def as_given(spec: str, backend: str, strict: bool) -> PreparedSchema:
        return PreparedSchema(schema=parse_schema(spec), guard=None, unenforced=())

    saved = xgrammar_backend.prepare_json_schema, outlines_backend.prepare_json_schema
    xgrammar_backend.prepare_json_schema = outlines_backend.prepare_json_schema = as_given
    try:
        yield
    finally:
        xgrammar_backend.prepare_json_schema, outlines_backend.prepare_json_schema = saved


async def _generate_all(engine: Any, prompts: list[list[int]], schemas: list[dict],
                        backend: str, max_new_tokens: int) -> list[dict | Exception]:
    from arborlm.errors import InvalidRequestError

    async def one(ids: list[int], schema: dict) -> dict | Exception:
        try:
            return await engine.async_generate(input_ids=ids, sampling_params={
                "max_new_tokens": max_new_tokens, "temperature": 0,
                "json_schema": json.dumps(schema), "grammar_backend": backend})
        except InvalidRequestError as e:
            return e

    outs: list[dict | Exception] = []
    for start in range(0, len(prompts), CHUNK):
        part = zip(prompts[start:start + CHUNK], schemas[start:start + CHUNK])
        outs += await asyncio.gather(*(one(p, s) for p, s in part))
    return outs


def coverage_prompt(tokenizer: Any, schema: dict, schema_tokens: int = SCHEMA_TOKENS
                    ) -> list[int]:
    """The prompt's token ids: one user turn showing the schema compactly, its first
    `schema_tokens` tokens at most, a cut marked as such, in the model's chat template."""
    shown = json.dumps(schema, separators=(",", ":"))
    ids = tokenizer.encode(shown, add_special_tokens=False)
    if len(ids) > schema_tokens:
        shown = (tokenizer.decode(ids[:schema_tokens]) + f" ... [schema cut: {schema_tokens} of "
                 f"{len(ids)} tokens shown]")
    messages = [{"role": "user", "content": "Write a JSON object that matches this JSON schema. "
                 "Reply with the JSON only.\n" + shown}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def run_side(engine: Any, side: str, backend: str, rows: list[tuple[str, dict]],
             max_new_tokens: int, schema_tokens: int = SCHEMA_TOKENS) -> Coverage:
    prompts = [coverage_prompt(engine.tokenizer, schema, schema_tokens) for _, schema in rows]
    start = time.perf_counter()
    outs = asyncio.run(_generate_all(engine, prompts, [s for _, s in rows], backend,
                                     max_new_tokens))
    cov = Coverage(side, schemas=len(rows), seconds=time.perf_counter() - start,
                   prompt_tokens=sum(map(len, prompts)))
    for (sid, schema), out in zip(rows, outs):
        if isinstance(out, Exception):
            param = getattr(out, "param", None)
            cov.too_long += param in ("input_ids", "max_new_tokens", "text")
            continue
        cov.accepted += 1
        cov.tokens += len(out["output_ids"])
        reason = out["meta_info"]["finish_reason"]["type"]
        if reason == "abort":
            cov.aborted += 1
        if reason != "stop":
            continue
        cov.finished += 1
        ok, why = _validates(schema, out["text"])
        if ok:
            cov.valid += 1
        else:
            cov.invalid.append((sid, why, out["text"][:160]))
    return cov


def unguarded(rows: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The schemas ArborLM compiles for xgrammar without a guard plan."""
    from arborlm.constrained.schema_prepare import prepare_json_schema
    from arborlm.errors import GrammarError

    keep = []
    for sid, schema in rows:
        try:
            if prepare_json_schema(json.dumps(schema), "xgrammar", True).guard is None:
                keep.append((sid, schema))
        except (GrammarError, ValueError):
            continue
    return keep


def overhead_rows(make_engine, rows: list[tuple[str, dict]], n: int, max_new_tokens: int,
                  repeats: int) -> tuple[list[tuple], float]:
    """ArborLM against xgrammar alone on schemas that need no guard: tokens/s each, alternating
    (both engines alive, one run at a time); returns the rows and the median ratio."""
    sample = unguarded(rows)[:n]
    arbor = make_engine()
    with engine_alone():
        alone = make_engine()
    speeds: dict[str, list[float]] = {"ArborLM": [], "xgrammar alone": []}
    try:
        for i in range(repeats):
            order = [("ArborLM", arbor), ("xgrammar alone", alone)]
            for name, engine in order if i % 2 == 0 else order[::-1]:
                if name == "xgrammar alone":
                    with engine_alone():
                        cov = run_side(engine, name, "xgrammar", sample, max_new_tokens)
                else:
                    cov = run_side(engine, name, "xgrammar", sample, max_new_tokens)
                speeds[name].append(cov.tokens / cov.seconds)
    finally:
        arbor.shutdown()
        alone.shutdown()
    ratio = statistics.median(a / b for a, b in zip(speeds["ArborLM"], speeds["xgrammar alone"]))
    rows_out = [(name, len(sample), f"{statistics.median(v):.0f}") for name, v in speeds.items()]
    return rows_out, ratio

"""JSON-schema coverage on a real model: schemas accepted, outputs finished, outputs valid.

Every schema of JSONSchemaBench's dev sample (`shared/data/jsonschemabench-dev.jsonl` beside the
repository) goes to the engine as one greedy request whose prompt shows the schema (the user turn
of `tests/real_model/test_json_schemas.py`), on three sides, one after the other in one engine.
The prompt shows the schema compactly (no spaces) and at most `--coverage-schema-tokens`
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

ArborLM runs first, on all the schemas, then the engine-alone sides on a seeded random sample
(`--coverage-alone-schemas`), which ArborLM took last: the three sides share one engine, so each
sampled prompt is prefilled once and found in the prefix cache by the other two sides (an alone
side's schema text is indented, so that its compile is not ArborLM's cached one). Each side
keeps `--coverage-concurrency` requests in flight (a new one starts as one finishes), so the
batch stays full. A compile gets `COMPILE_TIMEOUT_S` (a busy machine must not turn into refused
schemas); one that still times out is counted apart.

For each side: schemas accepted (the rest refused at compile, or whose prompt does not fit the
context), outputs finished (stopped within `--max-new-tokens`), finished outputs that validate
(`jsonschema`, the schema's own draft), outputs aborted (the guard's dead ends), output tokens
per second over the side. ArborLM also gets a row over the alone sides' sample. Invalid finished
outputs are listed with their schema id (and printed as they come), so that each can become a
regression test of its cause.

Then the guard's overhead on schemas that need none: the schemas ArborLM compiles without a
guard plan, a sample of `--overhead-schemas`, run by ArborLM and by xgrammar alone alternately
in the same engine (`--repeats` pairs), output tokens/s each and the median ratio.

    python benchmarks/constrained.py --coverage-max-new-tokens 256 --coverage-alone-schemas 100
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench-dev.jsonl"
CONCURRENCY = 64  # requests in flight at once
SCHEMA_TOKENS = 1500  # of the schema shown in a prompt (the rest is cut, marked)
COMPILE_TIMEOUT_S = 300.0


@dataclass
class Coverage:
    side: str
    schemas: int = 0
    accepted: int = 0
    too_long: int = 0  # prompt + max_new_tokens past the context: not a schema problem
    timed_out: int = 0  # compile past COMPILE_TIMEOUT_S: counted as not accepted
    finished: int = 0
    valid: int = 0
    aborted: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    invalid: list[tuple[str, str, str]] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)

    def row(self) -> tuple:
        counted = self.schemas - self.too_long
        return (self.side, f"{self.accepted}/{counted}", f"{self.finished}/{self.accepted}",
                f"{self.valid}/{self.finished}", self.aborted, self.timed_out,
                f"{self.tokens / self.seconds:.0f}" if self.seconds else "-")


HEADER = ("side", "accepted", "finished", "valid", "aborted", "compile timed out",
          "output tok/s")


def load_all(n: int) -> list[tuple[str, dict]]:
    rows = [json.loads(line) for line in BENCH.read_text().splitlines()[:n]]
    return [(row["id"], row["schema"]) for row in rows]


def alone_sample(rows: list[tuple[str, dict]], n: int | None, seed: int
                 ) -> list[tuple[str, dict]]:
    """A seeded random sample of `n` rows (all of them when `n` is None or too large), in
    their file order."""
    if n is None or n >= len(rows):
        return list(rows)
    keep = set(random.Random(seed).sample(range(len(rows)), n))
    return [row for i, row in enumerate(rows) if i in keep]


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


def schema_text(schema: dict, alone: bool) -> str:
    """The request's `json_schema`: an engine-alone side's is indented, so that the engine's
    compile cache (keyed by the text) never hands one side the other's grammar."""
    return json.dumps(schema, indent=1 if alone else None)


async def _generate_all(engine: Any, prompts: list[list[int]], specs: list[str], backend: str,
                        max_new_tokens: int, concurrency: int, on_done: Any
                        ) -> list[dict | Exception]:
    from arborlm.errors import InvalidRequestError

    slots = asyncio.Semaphore(concurrency)
    outs: list[dict | Exception] = [None] * len(prompts)  # type: ignore[list-item]

    async def one(i: int) -> None:
        async with slots:
            try:
                outs[i] = await engine.async_generate(input_ids=prompts[i], sampling_params={
                    "max_new_tokens": max_new_tokens, "temperature": 0,
                    "json_schema": specs[i], "grammar_backend": backend})
            except InvalidRequestError as e:
                outs[i] = e
        on_done(i, outs[i])

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
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


class _Tally:
    """Outcomes of one side, counted as they come (progress and invalid outputs printed)."""

    def __init__(self, side: str, rows: list[tuple[str, dict]], verbose: bool) -> None:
        self.cov = Coverage(side, schemas=len(rows))
        self.rows, self.verbose = rows, verbose
        self.outcome: dict[str, str] = {}  # schema id: refused / too long / ... / invalid
        self.start = time.perf_counter()

    def __call__(self, i: int, out: dict | Exception) -> None:
        sid, schema = self.rows[i]
        self.outcome[sid] = self._count(sid, schema, out)
        done = len(self.outcome)
        if self.verbose and (done % 50 == 0 or done == len(self.rows)):
            print(f"  {self.cov.side}: {done}/{len(self.rows)} in "
                  f"{time.perf_counter() - self.start:.0f} s: "
                  + ", ".join(f"{k} {v}" for k, v in zip(HEADER[1:-1], self.cov.row()[1:-1])),
                  flush=True)

    def _count(self, sid: str, schema: dict, out: dict | Exception) -> str:
        cov = self.cov
        if isinstance(out, Exception):
            if getattr(out, "param", None) in ("input_ids", "max_new_tokens", "text"):
                cov.too_long += 1
                return "too long"
            if "timed out" in str(out):
                cov.timed_out += 1
                return "timed out"
            return "refused"
        cov.accepted += 1
        cov.tokens += len(out["output_ids"])
        reason = out["meta_info"]["finish_reason"]
        if reason["type"] == "abort":
            cov.aborted += 1
            cov.aborts.append((sid, reason.get("message", "")[:200]))
            return "aborted"
        if reason["type"] != "stop":
            return "length"
        cov.finished += 1
        ok, why = _validates(schema, out["text"])
        if ok:
            cov.valid += 1
            return "valid"
        cov.invalid.append((sid, why, out["text"][:160]))
        if self.verbose:
            print(f"  invalid ({cov.side}) {sid}: {why}\n    {out['text'][:160]!r}", flush=True)
        return "invalid"


def run_side(engine: Any, side: str, backend: str, rows: list[tuple[str, dict]],
             max_new_tokens: int, schema_tokens: int = SCHEMA_TOKENS, *,
             alone: bool = False, concurrency: int = CONCURRENCY, verbose: bool = False
             ) -> tuple[Coverage, dict[str, str]]:
    """One side over `rows` (an engine-alone side with `alone`): its coverage and each
    schema's outcome by id."""
    prompts = [coverage_prompt(engine.tokenizer, schema, schema_tokens) for _, schema in rows]
    specs = [schema_text(schema, alone) for _, schema in rows]
    tally = _Tally(side, rows, verbose)
    tally.cov.prompt_tokens = sum(map(len, prompts))
    with engine_alone() if alone else _nothing():
        asyncio.run(_generate_all(engine, prompts, specs, backend, max_new_tokens, concurrency,
                                  tally))
    tally.cov.seconds = time.perf_counter() - tally.start
    return tally.cov, tally.outcome


@contextmanager
def _nothing():
    yield


def recount(side: str, rows: list[tuple[str, dict]], full: Coverage,
            outcome: dict[str, str]) -> Coverage:
    """`full`'s counts over `rows` only (a subset of its schemas), from each one's outcome;
    no token count or time (those are the whole side's)."""
    cov = Coverage(side, schemas=len(rows))
    ids = {sid for sid, _ in rows}
    for sid in ids:
        what = outcome[sid]
        cov.too_long += what == "too long"
        cov.timed_out += what == "timed out"
        cov.accepted += what in ("aborted", "length", "valid", "invalid")
        cov.aborted += what == "aborted"
        cov.finished += what in ("valid", "invalid")
        cov.valid += what == "valid"
    cov.invalid = [x for x in full.invalid if x[0] in ids]
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


def overhead_rows(engine: Any, rows: list[tuple[str, dict]], n: int, max_new_tokens: int,
                  repeats: int) -> tuple[list[tuple], float]:
    """ArborLM against xgrammar alone on schemas that need no guard, in `engine`: tokens/s
    each, alternating (one run at a time, prompts cached by a first run of each); returns the
    rows and the median ratio."""
    sample = unguarded(rows)[:n]
    for alone in (False, True):  # compiles and prefills, not timed
        run_side(engine, "warm-up", "xgrammar", sample, max_new_tokens, alone=alone)
    speeds: dict[str, list[float]] = {"ArborLM": [], "xgrammar alone": []}
    for i in range(repeats):
        order = [("ArborLM", False), ("xgrammar alone", True)]
        for name, alone in order if i % 2 == 0 else order[::-1]:
            cov, _ = run_side(engine, name, "xgrammar", sample, max_new_tokens, alone=alone)
            speeds[name].append(cov.tokens / cov.seconds)
    ratio = statistics.median(a / b for a, b in zip(speeds["ArborLM"], speeds["xgrammar alone"]))
    rows_out = [(name, len(sample), f"{statistics.median(v):.0f}") for name, v in speeds.items()]
    return rows_out, ratio

"""Constrained decoding in the engine: JSON-schema coverage, and batches against the same batch
unconstrained.

On the default model (SmolLM2-135M-Instruct, the real one), in one run:

0. coverage of JSONSchemaBench's dev sample (`--coverage-schemas`, all 500 by default; 0 skips
   it): schemas accepted, outputs finished, finished outputs valid, for xgrammar alone,
   outlines-core alone and ArborLM (rewrites + semantic guard, strict), and the guard's overhead
   on the schemas that need none (`schema_coverage.py` says how). The rest runs in one engine:

1. decode throughput of a batch of `--batch` greedy requests under one JSON schema, per grammar
   backend, with jump-forward on and (for the default backend) off, against the same prompts
   unconstrained with each request's `max_new_tokens` set to its output length in that
   configuration (`ignore_eos`), so both sides generate exactly the same number of tokens.
   Prompts are cached by a warm-up run, so each timed run is one 1-token prefill step and then
   decoding.
   Each configuration is timed against the unconstrained batch in adjacent pairs (which one
   goes first alternates), `--repeats` times. "vs plain" is the median of the pairs'
   throughput ratios, by wall time and by this process's CPU time; on a shared machine other
   processes slow some runs at random, which the wall-time ratio suffers from and the CPU-time
   ratio much less (the target is judged on it). "grammar time" is the share of the
   constrained runs' wall time spent inside the scheduler's grammar manager (masks, accepts,
   jump-forward walks). Every constrained output is checked with `jsonschema`.
2. per-token mask time (median, p99) for each backend: `fill_bitmask` plus
   `apply_token_bitmask_` on a vocabulary-wide row, replaying that backend's outputs.
3. compile time (median, p90) for each backend over a seeded sample of JSONSchemaBench schemas
   (`shared/data/jsonschemabench-dev.jsonl`), each compiled once, without a cache, through
   ArborLM's pipeline (strict) and by the backend alone; `--compile-only` runs this table
   alone (`--compile-schemas 500`: all of them).
4. decode steps saved by jump-forward: "forced tokens" counts, over the batch, the tokens
   that took no decode step of their own (`meta_info.jump_forward_steps`); "decode steps"
   counts the engine's batched decode steps for the whole batch. At batch 16 the scheduler
   computes forced tokens in one extend only when the step holds at least one per request
   (`JUMP_EXTEND_PER_REQUEST`), so fewer steps are saved there than for requests run one at a
   time, which the last table shows (decode steps and latency per request, on and off).

Targets: >= 98% of the 500 schemas accepted by ArborLM in strict mode, every finished output
valid; constrained throughput >= 90% of unconstrained at batch 16; the guard's overhead on
schemas that need none <= 10%.

    python benchmarks/constrained.py
    python benchmarks/constrained.py --coverage-schemas 0   # the throughput sections only
    python benchmarks/constrained.py --overhead-only --coverage-schemas 100   # the guard's cost
    python benchmarks/constrained.py --repeats 5 --compile-schemas 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import table  # noqa: E402
from grammar_engines import compile_all, load_schemas, percentile  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"enum": [21, 34, 55, 89]},
        "email": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "role", "active", "tags", "address"],
}


def prompts(n: int) -> list[str]:
    return [f"Record {i}: describe user number {i} of the staff directory as JSON." for i in
            range(n)]


@dataclass
class Run:
    seconds: float
    cpu_seconds: float  # this process's CPU time: not inflated by other processes' load
    outs: list[dict]
    decode_steps: int
    grammar_seconds: float  # inside the grammar manager: masks, accepts, jump-forward walks


class GrammarTimer:
    """Wall time the scheduler spends in its grammar manager's per-step calls."""

    def __init__(self, grammars) -> None:
        self.seconds = 0.0
        for name in ("apply_mask", "accept", "jump_forward"):
            setattr(grammars, name, self._timed(getattr(grammars, name)))

    def _timed(self, fn):
        def timed_call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed_call


def timed(engine, timer: GrammarTimer, texts: list[str], params: list[dict]) -> Run:
    before, grammar_before = engine.get_server_info()["decode_steps"], timer.seconds
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = engine.generate(texts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return Run(elapsed, cpu, outs, engine.get_server_info()["decode_steps"] - before,
               timer.seconds - grammar_before)


def set_jump_forward(engine, enabled: bool) -> None:
    grammars = engine.scheduler.grammars
    engine.client.call(lambda: setattr(grammars, "jump_forward_enabled", enabled))


def check_outputs(outs: list[dict]) -> None:
    import jsonschema

    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def mask_times(backend, outs: list[dict], vocab: int) -> list[float]:
    """Per-token seconds of fill_bitmask + apply_token_bitmask_, replaying `outs`."""
    from arborlm.constrained.bitmask import allocate_token_bitmask, apply_token_bitmask_

    grammar = backend.compile("json_schema", json.dumps(SCHEMA))
    mask = allocate_token_bitmask(1, vocab)  # [1, W]
    logits = torch.randn(1, vocab)  # [1, V]
    times = []
    for out in outs:
        matcher = grammar.matcher()
        for token in out["output_ids"]:
            row = logits.clone()
            start = time.perf_counter()
            matcher.fill_bitmask(mask, 0)
            apply_token_bitmask_(row, mask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(token)
    return times


def run_throughput(engine, args, backends: list[str]) -> tuple[list[tuple], dict[str, list]]:
    """Warm up every configuration, then time each against the unconstrained batch in adjacent
    pairs (alternating which goes first), `args.repeats` times."""
    texts = prompts(args.batch)
    base = {"temperature": 0, "max_new_tokens": args.max_new_tokens,
            "json_schema": json.dumps(SCHEMA)}
    configs = [(f"{b}, jump-forward", [{**base, "grammar_backend": b}] * len(texts), True)
               for b in backends]
    configs.append((f"{backends[0]}, no jump-forward", configs[0][1], False))
    outputs, plain = {}, {}
    for label, params, _ in configs:
        outputs[label] = engine.generate(texts, params)
        check_outputs(outputs[label])
        # The unconstrained twin: same prompts, each output exactly as long as constrained.
        plain[label] = [{"temperature": 0, "max_new_tokens": len(o["output_ids"]),
                         "ignore_eos": True} for o in outputs[label]]
        engine.generate(texts, plain[label])
    timer = GrammarTimer(engine.scheduler.grammars)
    runs: dict[str, list[tuple[Run, Run]]] = {label: [] for label, _, _ in configs}
    for repeat in range(args.repeats):
        for label, params, jump in configs:
            set_jump_forward(engine, jump)
            pair = [("plain", plain[label]), ("constrained", params)]
            order = pair if repeat % 2 == 0 else pair[::-1]
            timings = {name: timed(engine, timer, texts, p) for name, p in order}
            check_outputs(timings["constrained"].outs)
            runs[label].append((timings["plain"], timings["constrained"]))
    set_jump_forward(engine, True)
    return summarize(runs), {label: outputs[label] for label, _, jump in configs if jump}


def summarize(runs: dict[str, list[tuple[Run, Run]]]) -> list[tuple]:
    """One row per configuration, after the unconstrained runs of the first one."""
    def tokens(run: Run) -> int:
        return sum(len(o["output_ids"]) for o in run.outs)

    def ratio(pairs: list[tuple[Run, Run]], cpu: bool) -> str:
        def seconds(run: Run) -> float:
            return run.cpu_seconds if cpu else run.seconds

        ratios = [tokens(c) / seconds(c) / (tokens(p) / seconds(p)) for p, c in pairs]
        return f"{100 * statistics.median(ratios):.0f}%"

    rows = []
    for label, pairs in runs.items():
        constrained = [c for _, c in pairs]
        first = constrained[0]
        grammar = statistics.median(c.grammar_seconds / c.seconds for c in constrained)
        rows.append((label, tokens(first), first.decode_steps,
                     sum(o["meta_info"].get("jump_forward_steps", 0) for o in first.outs),
                     f"{statistics.median(tokens(c) / c.seconds for c in constrained):.0f}",
                     ratio(pairs, cpu=False), ratio(pairs, cpu=True), f"{100 * grammar:.1f}%"))
    plain_runs = [p for p, _ in next(iter(runs.values()))]
    rows.insert(0, ("unconstrained", tokens(plain_runs[0]), plain_runs[0].decode_steps, 0,
                    f"{statistics.median(tokens(p) / p.seconds for p in plain_runs):.0f}",
                    "100%", "100%", "0.0%"))
    return rows


def verdict(rows: list[tuple]) -> str:
    worst = min(int(row[6].rstrip("%")) for row in rows[1:])
    return (f"target: constrained >= 90% of unconstrained (CPU-time ratio): "
            f"{'met' if worst >= 90 else 'NOT met'} (lowest {worst}%)")


def run_alone(engine, args, backend: str) -> list[tuple]:
    """Jump-forward on and off for requests run one at a time (`--alone` of the prompts)."""
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens,
              "json_schema": json.dumps(SCHEMA), "grammar_backend": backend}
    timer = GrammarTimer(engine.scheduler.grammars)
    runs: dict[bool, list[Run]] = {True: [], False: []}
    for repeat in range(args.repeats):
        for text in prompts(args.alone):
            for jump in ((True, False) if repeat % 2 == 0 else (False, True)):
                set_jump_forward(engine, jump)
                runs[jump].append(timed(engine, timer, [text], [params]))
    set_jump_forward(engine, True)
    rows = []
    for jump, label in ((False, "no jump-forward"), (True, "jump-forward")):
        samples = runs[jump]
        rows.append((f"{backend}, {label}",
                     f"{statistics.median(r.decode_steps for r in samples):.0f}",
                     f"{statistics.median(r.seconds for r in samples) * 1e3:.0f}",
                     f"{statistics.median(r.cpu_seconds for r in samples) * 1e3:.0f}",
                     f"{statistics.median(len(r.outs[0]['output_ids']) for r in samples):.0f}"))
    return rows


def compile_rows(engine, args, backends: list[str]) -> list[tuple]:
    """Per backend: ArborLM's pipeline (checks, rewrites, guard plan; strict), then the
    backend alone (the schema as given, `schema_coverage.engine_alone`)."""
    from schema_coverage import engine_alone

    from arborlm.constrained import create_grammar_backend

    schemas = load_schemas(args.compile_schemas, args.seed)
    rows = []
    for name in backends:
        for alone in (False, True):
            backend = create_grammar_backend(name, engine.tokenizer,
                                             engine.config.model.vocab_size,
                                             list(engine.scheduler.results.eos_ids),
                                             compile_timeout_s=args.compile_timeout)
            with engine_alone() if alone else contextlib.nullcontext():
                _, outcome, times = compile_all(backend, schemas)
            rows.append((f"{name} alone" if alone else f"ArborLM ({name}, strict)",
                         f"{outcome['compiled']}/{len(schemas)}", outcome["refused"],
                         outcome["timed out"], f"{percentile(times, 50) * 1e3:.1f}",
                         f"{percentile(times, 90) * 1e3:.1f}"))
            print(f"  compiled: {rows[-1]}", flush=True)
    return rows


def print_compile_rows(engine, args, backends: list[str]) -> None:
    compiled = compile_rows(engine, args, backends)
    print(f"\ncompile: {len(load_schemas(args.compile_schemas, args.seed))} JSONSchemaBench "
          f"schemas (seed {args.seed}), one at a time, limit {args.compile_timeout:g} s, no "
          f"cache, load average {os.getloadavg()[0]:.1f}")
    print(table(compiled, ("pipeline", "compiled", "refused", "timed out", "p50 ms", "p90 ms")))
    sys.stdout.flush()


def coverage(args) -> None:
    import schema_coverage as sc

    from arborlm.runtime.engine import Engine

    rows = sc.load_all(args.coverage_schemas)
    sample = sc.alone_sample(rows, args.coverage_alone_schemas, args.seed)
    in_sample = {sid for sid, _ in sample}
    # ArborLM first (its figures matter most), the sample last: its prompts are then still in
    # the prefix cache for the engine-alone sides.
    arbor_rows = [row for row in rows if row[0] not in in_sample] + sample
    engine = Engine(args.model_path, grammar_compile_timeout=sc.COMPILE_TIMEOUT_S)
    start = time.perf_counter()
    results, outcome = [], {}
    try:
        for side, backend, alone, side_rows in (
                ("ArborLM", "xgrammar", False, arbor_rows),
                ("xgrammar alone", "xgrammar", True, sample),
                ("outlines-core alone", "outlines", True, sample)):
            cov, side_outcome = sc.run_side(engine, side, backend, side_rows,
                                            args.coverage_max_new_tokens,
                                            args.coverage_schema_tokens, alone=alone,
                                            concurrency=args.coverage_concurrency, verbose=True)
            outcome = outcome or side_outcome  # ArborLM's
            results.append(cov)
            print(f"{side}: done in {cov.seconds:.0f} s ({cov.prompt_tokens} prompt tokens, "
                  f"load average {os.getloadavg()[0]:.1f}): "
                  + ", ".join(f"{k} {v}" for k, v in zip(sc.HEADER[1:], cov.row()[1:])),
                  flush=True)
        if len(sample) < len(rows):
            results.append(sc.recount(f"ArborLM, the same {len(sample)}", sample, results[0],
                                      outcome))
        coverage_seconds = time.perf_counter() - start
        info = engine.get_server_info()
        overhead, ratio = sc.overhead_rows(engine, rows, args.overhead_schemas,
                                        args.overhead_max_new_tokens, args.repeats)
    finally:
        engine.shutdown()
    arbor = results[0]
    print(f"\ncoverage: {len(rows)} JSONSchemaBench dev schemas (the engine-alone sides: a "
          f"random sample of {len(sample)}, seed {args.seed}), greedy, at most "
          f"{args.coverage_max_new_tokens} new tokens, schemas shown compactly up to "
          f"{args.coverage_schema_tokens} tokens, {args.coverage_concurrency} requests in "
          f"flight, one engine; {coverage_seconds:.0f} s in all ({arbor.too_long} prompts too "
          f"long for the context are not counted); guard bans {info['grammar_guard_bans']}, "
          f"rollbacks {info['grammar_guard_rollbacks']}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(table([c.row() for c in results], sc.HEADER))
    counted = arbor.schemas - arbor.too_long
    print(f"target: >= 98% accepted in strict mode: {100 * arbor.accepted / counted:.1f}% "
          f"({'met' if arbor.accepted >= 0.98 * counted else 'NOT met'}); every finished "
          f"output valid: {arbor.valid}/{arbor.finished} "
          f"({'met' if arbor.valid == arbor.finished else 'NOT met'})")
    for c in results[:3]:
        for sid, why, text in c.invalid:
            print(f"  invalid ({c.side}) {sid}: {why}\n    {text!r}")
    for sid, why in arbor.aborts:
        print(f"  aborted (ArborLM) {sid}: {why}")
    print(f"\nguard overhead: schemas that need no guard, {args.repeats} alternating runs in "
          f"one engine, at most {args.overhead_max_new_tokens} new tokens (median output tok/s)")
    print(table(overhead, ("side", "schemas", "output tok/s")))
    print(f"ArborLM / xgrammar alone: {ratio:.3f} (target >= 0.90)\n", flush=True)


def overhead_only(args) -> None:
    """The guard-overhead section alone (`--overhead-only`): no coverage sides before it."""
    import schema_coverage as sc

    from arborlm.runtime.engine import Engine

    engine = Engine(args.model_path, grammar_compile_timeout=sc.COMPILE_TIMEOUT_S)
    try:
        overhead, ratio = sc.overhead_rows(engine, sc.load_all(args.coverage_schemas),
                                           args.overhead_schemas, args.overhead_max_new_tokens,
                                           args.repeats)
    finally:
        engine.shutdown()
    print(f"guard overhead: schemas that need no guard (of the first {args.coverage_schemas}), "
          f"{args.repeats} alternating runs in one engine, at most "
          f"{args.overhead_max_new_tokens} new tokens (median output tok/s); load average "
          f"{os.getloadavg()[0]:.1f}")
    print(table(overhead, ("side", "schemas", "output tok/s")))
    print(f"ArborLM / xgrammar alone: {ratio:.3f} (target >= 0.90)\n", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="default: the built-in default model")
    ap.add_argument("--dtype", default="float32", help="engine dtype (auto, float32, bfloat16)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--alone", type=int, default=4,
                    help="prompts also run one at a time, jump-forward on and off")
    ap.add_argument("--backends", default="xgrammar,outlines")
    ap.add_argument("--compile-schemas", type=int, default=20,
                    help="JSONSchemaBench schemas for the compile-time figures")
    ap.add_argument("--compile-timeout", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--coverage-schemas", type=int, default=500,
                    help="JSONSchemaBench schemas for the coverage table (0: skip it)")
    ap.add_argument("--coverage-max-new-tokens", type=int, default=512)
    ap.add_argument("--coverage-schema-tokens", type=int, default=1500,
                    help="tokens of each schema shown in its prompt (longer ones are cut, "
                         "marked; the grammar still enforces the whole schema)")
    ap.add_argument("--coverage-alone-schemas", type=int, default=None,
                    help="a random sample (--seed) of this many schemas for the engine-alone "
                         "sides (default: all --coverage-schemas)")
    ap.add_argument("--coverage-concurrency", type=int, default=64,
                    help="coverage requests in flight at once")
    ap.add_argument("--overhead-schemas", type=int, default=32)
    ap.add_argument("--overhead-max-new-tokens", type=int, default=96)
    ap.add_argument("--compile-only", action="store_true",
                    help="only the compile table")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the guard-overhead table (on the first --coverage-schemas)")
    args = ap.parse_args()
    if args.overhead_only:
        overhead_only(args)
        os._exit(0)
    if args.coverage_schemas and not args.compile_only:
        coverage(args)

    from arborlm.constrained import create_grammar_backend
    from arborlm.runtime.engine import Engine

    backends = args.backends.split(",")
    engine = Engine(args.model_path, dtype=args.dtype)
    vocab = engine.config.model.vocab_size
    dtype = str(engine.config.model.dtype).removeprefix("torch.")
    print(f"model {engine.config.model.path} (vocabulary {vocab}, {dtype}), batch {args.batch}, "
          f"greedy, {args.repeats} repeats, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    if args.compile_only:
        print_compile_rows(engine, args, backends)
        engine.shutdown()
        os._exit(0)
    rows, outputs = run_throughput(engine, args, backends)
    print("decode throughput (same prompts and output lengths)")
    print(table(rows, ("configuration", "tokens", "decode steps", "forced tokens", "tok/s",
                       "vs plain (wall)", "vs plain (CPU)", "grammar time")))
    print(verdict(rows))
    if args.alone:
        alone = run_alone(engine, args, backends[0])
        print(f"\none request at a time ({args.alone} prompts; medians)")
        print(table(alone, ("configuration", "decode steps", "latency ms", "CPU ms", "tokens")))
    mask_table = []
    for name in backends:
        backend = create_grammar_backend(name, engine.tokenizer, vocab,
                                         list(engine.scheduler.results.eos_ids))
        times = mask_times(backend, outputs[f"{name}, jump-forward"], vocab)
        mask_table.append((name, len(times), f"{percentile(times, 50) * 1e6:.1f}",
                           f"{percentile(times, 99) * 1e6:.1f}"))
    print(f"\nmask per token: fill_bitmask + apply_token_bitmask_ on a {vocab}-wide row")
    print(table(mask_table, ("backend", "tokens", "p50 us", "p99 us")))
    if args.compile_schemas:
        print_compile_rows(engine, args, backends)
    engine.shutdown()
    os._exit(0)  # do not wait for compiles abandoned at their time limit


if __name__ == "__main__":
    main()

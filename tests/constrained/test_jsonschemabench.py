"""Real-world schemas (a seeded sample of shared/data/jsonschemabench-dev.jsonl).

Each compile either succeeds or fails with a `GrammarError` naming the problem, within the time
limit; nothing crashes or hangs. Outputs of the schemas that compile validate against them.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest

from arborlm.constrained import create_grammar_backend
from arborlm.constrained.base import CompiledGrammar, GrammarBackend
from arborlm.constrained.compile_cache import GrammarCompiler
from arborlm.errors import GrammarError
from tests.constrained.conftest import EOS, VOCAB
from tests.constrained.driver import closing_bias, generate

BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench-dev.jsonl"
SAMPLE = {"xgrammar": 40, "outlines": 12}  # outlines compiles are far slower
TIMEOUT_S = {"xgrammar": 10.0, "outlines": 3.0}


def _sample(n: int) -> list[dict]:
    rows = [json.loads(line) for line in BENCH.read_text().splitlines()]
    return random.Random(2024).sample(rows, n)


@pytest.mark.skipif(not BENCH.exists(), reason=f"{BENCH} not present")
@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_bench_sample_compiles_or_fails_cleanly(tokenizer, name: str,
                                                capsys: pytest.CaptureFixture) -> None:
    backend: GrammarBackend = create_grammar_backend(name, tokenizer, VOCAB, [EOS],
                                                     compile_timeout_s=TIMEOUT_S[name])
    compiler = GrammarCompiler({name: backend}, name, max_workers=2)
    rows = _sample(SAMPLE[name])
    futures: list[Future] = [compiler.submit("json_schema", json.dumps(r["schema"]))
                             for r in rows]
    compiled, refused, validated = 0, [], 0
    bias = closing_bias(backend.vocab)
    for seed, (row, future) in enumerate(zip(rows, futures)):
        error = future.exception(timeout=TIMEOUT_S[name] + 30)
        if error is not None:
            assert isinstance(error, GrammarError) and str(error).strip(), repr(error)
            refused.append(f"{row['id']}: {error}")
            continue
        grammar = future.result()
        assert isinstance(grammar, CompiledGrammar)
        compiled += 1
        result = generate(grammar.matcher(), backend.vocab, seed=seed, budget=300, bias=bias)
        if result.terminated:
            jsonschema.validate(json.loads(result.text(backend.vocab)), row["schema"])
            validated += 1
    compiler.shutdown()
    with capsys.disabled():
        print(f"\n[{name}] JSONSchemaBench sample: {compiled}/{len(rows)} compiled, "
              f"{validated} outputs validated; refused:")
        for line in refused:
            print(f"  {line[:220]}")
    if name == "xgrammar":
        assert compiled >= 0.6 * len(rows)
    assert validated >= 0.8 * compiled

"""`GrammarCompiler`: thread pool, bounded cache, cached errors, timeouts, backend choice."""

from __future__ import annotations

import json
import time

import pytest

from arborlm.constrained import create_grammar_backend
from arborlm.constrained.base import GrammarBackend
from arborlm.constrained.compile_cache import GrammarCompiler
from arborlm.constrained.outlines_backend import OutlinesCompiled
from arborlm.constrained.xgrammar_backend import XGrammarCompiled
from arborlm.errors import GrammarError
from tests.constrained.conftest import EOS, VOCAB

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"]})
# xgrammar 0.2.9 converts a long repetition of a negated class slowly (seconds, measured).
SLOW_SCHEMA = json.dumps({"type": "string", "pattern": "^[^ab]{0,2500}$"})


@pytest.fixture
def compiler(backends: dict[str, GrammarBackend]):
    instance = GrammarCompiler(backends, "xgrammar", max_workers=2, error_ttl_s=0.3)
    yield instance
    instance.shutdown()


def test_cache_hit_returns_the_same_grammar(compiler: GrammarCompiler) -> None:
    first = compiler.submit("json_schema", SCHEMA).result(timeout=30)
    second_future = compiler.submit("json_schema", SCHEMA)
    assert second_future.done()  # served from the cache at once
    assert second_future.result() is first
    assert (compiler.stats.hits, compiler.stats.misses) == (1, 1)
    compiler.submit("json_schema", SCHEMA, backend="outlines").result(timeout=30)
    assert compiler.stats.misses == 2  # the key includes the backend


def test_strict_is_part_of_the_key(compiler: GrammarCompiler) -> None:
    remote = json.dumps({"type": "object", "properties": {"a": {"$ref": "https://x.test/a"}}})
    with pytest.raises(GrammarError, match="#/properties/a/\\$ref"):
        compiler.submit("json_schema", remote).result(timeout=30)
    loose = compiler.submit("json_schema", remote, strict=False).result(timeout=30)
    assert loose.unenforced and "#/properties/a/$ref" in loose.unenforced[0]
    assert compiler.submit("json_schema", remote, strict=False).result() is loose
    assert compiler.submit("regex", "ab", strict=False).result(timeout=30) is \
        compiler.submit("regex", "ab").result(timeout=30)  # strict only matters for schemas


def test_concurrent_submits_share_one_compile(compiler: GrammarCompiler) -> None:
    futures = [compiler.submit("regex", "[a-f]{3}x") for _ in range(5)]
    results = {id(f.result(timeout=30)) for f in futures}
    assert len(results) == 1 and compiler.stats.misses == 1 and compiler.stats.hits == 4


def test_errors_are_cached_then_expire(compiler: GrammarCompiler) -> None:
    for _ in range(2):
        with pytest.raises(GrammarError, match="regex"):
            compiler.submit("regex", "(unclosed").result(timeout=30)
    assert (compiler.stats.misses, compiler.stats.hits, compiler.stats.errors) == (1, 1, 1)
    time.sleep(0.35)
    with pytest.raises(GrammarError):
        compiler.submit("regex", "(unclosed").result(timeout=30)
    assert compiler.stats.misses == 2


def test_backend_override_and_unknown_backend(compiler: GrammarCompiler) -> None:
    assert isinstance(compiler.submit("regex", "ab").result(timeout=30), XGrammarCompiled)
    assert isinstance(compiler.submit("regex", "ab", backend="outlines").result(timeout=30),
                      OutlinesCompiled)
    with pytest.raises(GrammarError, match="unknown grammar backend"):
        compiler.submit("regex", "ab", backend="llguidance").result(timeout=1)
    with pytest.raises(GrammarError, match="does not support ebnf"):
        compiler.submit("ebnf", 'root ::= "a"', backend="outlines").result(timeout=30)


def test_cache_is_bounded_lru(backends: dict[str, GrammarBackend]) -> None:
    compiler = GrammarCompiler(backends, "xgrammar", max_entries=2)
    for spec in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
        compiler.submit("regex", spec).result(timeout=30)
    assert len(compiler) == 2
    compiler.submit("regex", "a").result(timeout=30)
    assert compiler.stats.misses == 3
    compiler.submit("regex", "b").result(timeout=30)
    assert compiler.stats.misses == 4
    compiler.shutdown()


def test_slow_compile_times_out_without_blocking_others(tokenizer) -> None:
    slow_backend = create_grammar_backend("xgrammar", tokenizer, VOCAB, [EOS],
                                          compile_timeout_s=0.3)
    compiler = GrammarCompiler({"xgrammar": slow_backend}, max_workers=1, max_stalled=1)
    start = time.monotonic()
    slow = compiler.submit("json_schema", SLOW_SCHEMA)
    assert time.monotonic() - start < 0.1 and not slow.done()  # submit never waits
    longest_gap, last = 0.0, time.monotonic()
    while not slow.done():  # this thread keeps running while the engine compiles
        time.sleep(0.005)
        longest_gap, last = max(longest_gap, time.monotonic() - last), time.monotonic()
    assert longest_gap < 0.5  # the compile alone takes seconds
    with pytest.raises(GrammarError, match=r"timed out after 0.3 s"):
        slow.result()
    assert time.monotonic() - start < 3.0
    # The one worker slot is free again although the slow compile is still running.
    quick = compiler.submit("regex", "[0-9]{2}")
    assert isinstance(quick.result(timeout=5), XGrammarCompiled)
    assert compiler.stats.timeouts == 1
    with pytest.raises(GrammarError, match="timed out"):  # the timeout is cached too
        compiler.submit("json_schema", SLOW_SCHEMA).result(timeout=1)
    compiler.shutdown()


def test_cancelling_one_waiter_leaves_the_others(compiler: GrammarCompiler) -> None:
    spec = json.dumps({"type": "array", "items": {"type": "string"}, "maxItems": 3})
    first, second = compiler.submit("json_schema", spec), compiler.submit("json_schema", spec)
    first.cancel()
    assert isinstance(second.result(timeout=30), XGrammarCompiled)


def test_for_tokenizer_builds_backends_lazily(tokenizer) -> None:
    compiler = GrammarCompiler.for_tokenizer(tokenizer, VOCAB, [EOS], "outlines")
    assert compiler._backends == {}  # nothing built on the caller's thread
    grammar = compiler.submit("choices", json.dumps(["x", "y"])).result(timeout=30)
    assert isinstance(grammar, OutlinesCompiled) and list(compiler._backends) == ["outlines"]
    assert isinstance(compiler.submit("choices", '["x"]', backend="xgrammar").result(timeout=30),
                      XGrammarCompiled)
    compiler.shutdown()


def test_shutdown_fails_pending_waiters(tokenizer) -> None:
    backend = create_grammar_backend("xgrammar", tokenizer, VOCAB, [EOS])
    compiler = GrammarCompiler({"xgrammar": backend}, max_workers=1, max_stalled=0)
    running = compiler.submit("json_schema", SLOW_SCHEMA)
    queued = compiler.submit("regex", "[0-9]")
    compiler.shutdown()
    for future in (running, queued):
        with pytest.raises(GrammarError, match="shut down"):
            future.result(timeout=1)

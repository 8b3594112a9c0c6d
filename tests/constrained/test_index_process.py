"""outlines-core index builds in killable, memory-capped child processes (`index_process`).

The exploding regex is the textbook one: `[a-z]*a[a-z]{N}` ("an `a` N letters before the end")
has a minimal DFA of 2^(N+1) states, so its token index grows by hundreds of MB a second.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from arborlm.constrained.compile_cache import GrammarCompiler
from arborlm.constrained.index_process import IndexProcesses
from arborlm.constrained.outlines_backend import OutlinesBackend
from arborlm.constrained.vocab import TokenVocab
from arborlm.errors import GrammarError
from tests.constrained.conftest import EOS, VOCAB

EXPLODING = "[a-z]*a[a-z]{20}"
MiB = 1 << 20


@pytest.fixture(scope="module")
def vocab(tokenizer: Any) -> TokenVocab:
    return TokenVocab.from_tokenizer(tokenizer, VOCAB, [EOS])


def _processes(vocab: TokenVocab, memory_bytes: int) -> IndexProcesses:
    return IndexProcesses(vocab.stop_token_ids[0], vocab.text_token_ids(),
                          memory_bytes=memory_bytes)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _accepts(index: Any, text: bytes, vocab: TokenVocab) -> bool:
    """Whether `index` walks `text` one single-byte token at a time to a final state."""
    by_text = vocab.text_token_ids()
    state = index.get_initial_state()
    for byte in text:
        state = index.get_next_state(state, by_text[bytes([byte])][0])
        if state is None:
            return False
    return index.is_final_state(state)


def test_an_index_is_built_in_a_child_and_the_child_is_reused(vocab: TokenVocab) -> None:
    processes = _processes(vocab, 512 * MiB)
    try:
        index = processes.build("[0-9]{2,3}", 60)
        assert _accepts(index, b"123", vocab) and not _accepts(index, b"1", vocab)
        with pytest.raises(ValueError) as bad:
            processes.build("(unclosed", 60)
        assert not isinstance(bad.value, GrammarError)  # outlines-core's word, not ours
        assert _accepts(processes.build("ab+", 60), b"abbb", vocab)
        assert processes.started == 1  # an invalid regex does not cost its child
    finally:
        processes.close()


def test_an_exploding_index_ends_at_its_memory_cap_not_in_this_process(
        vocab: TokenVocab) -> None:
    processes = _processes(vocab, 256 * MiB)
    try:
        before = _rss_bytes()
        with pytest.raises(GrammarError, match="memory limit of 0.2 GiB"):
            processes.build(EXPLODING, 600)  # only the cap can end it
        assert _rss_bytes() - before < 64 * MiB
        assert _accepts(processes.build("[0-9]+", 60), b"42", vocab)
        assert processes.started == 2  # the capped child is gone; a fresh one served
    finally:
        processes.close()


def test_a_build_past_its_time_limit_is_killed(vocab: TokenVocab) -> None:
    processes = _processes(vocab, 8 << 30)
    try:
        start = time.monotonic()
        with pytest.raises(GrammarError, match="time limit of 0.5 s"):
            processes.build(EXPLODING, 0.5)
        # Killed at the limit, not left to run: the wait is the limit plus the kill.
        assert time.monotonic() - start < 30
        assert _accepts(processes.build("x", 60), b"x", vocab)
        assert processes.started == 2
    finally:
        processes.close()


def test_the_outlines_backend_refuses_an_exploding_schema_and_goes_on(tokenizer: Any) -> None:
    vocab = TokenVocab.from_tokenizer(tokenizer, VOCAB, [EOS])
    backend = OutlinesBackend(vocab, index_memory_bytes=256 * MiB, compile_timeout_s=600)
    compiler = GrammarCompiler({"outlines": backend}, "outlines", max_workers=1)
    try:
        schema = json.dumps({"type": "string", "pattern": f"^{EXPLODING}$"})
        with pytest.raises(GrammarError) as exploded:
            compiler.submit("json_schema", schema).result(timeout=600)
        assert exploded.value.param == "json_schema"
        assert "memory limit" in str(exploded.value)
        small = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["a"]})
        matcher = compiler.submit("json_schema", small).result(timeout=120).matcher()
        for token in tokenizer.encode('{"a":7}', add_special_tokens=False):
            assert matcher.accept_token(token)
        assert matcher.is_completed()
        with pytest.raises(GrammarError, match="invalid regex"):
            compiler.submit("regex", "(unclosed").result(timeout=120)
    finally:
        compiler.shutdown()
        backend.close()


def test_shutdown_ends_the_index_processes_of_the_backends_it_made(tokenizer: Any) -> None:
    compiler = GrammarCompiler.for_tokenizer(tokenizer, VOCAB, [EOS], "outlines")
    try:
        compiler.submit("regex", "[0-9]+").result(timeout=120)
        children = list(compiler.backend("outlines")._indexes._idle)
        assert len(children) == 1 and children[0].proc.poll() is None
    finally:
        compiler.shutdown()
    assert children[0].proc.wait(timeout=60) is not None

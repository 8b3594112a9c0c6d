"""Greedy generation matches transformers token for token, whatever the batching.

Every architecture on a tiny float32 model; then, on one model: alone vs a batch of 16 prompts
of mixed lengths, chunked prefill at several chunk sizes, page sizes, and forced retraction.
"""

from __future__ import annotations

import pytest

from arborlm import Engine
from tests.conftest import ARCHS
from tests.runtime.engine_helpers import (
    GREEDY,
    PROMPTS,
    DirectScheduler,
    hf_greedy,
    hf_tokenizer,
)


def _ids(path, prompt):
    return hf_tokenizer(str(path)).encode(prompt)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(make_tiny_model, arch):
    path = make_tiny_model(arch)
    engine = Engine(str(path), dtype="float32", debug_integrity=True)
    outs = engine.generate(PROMPTS[:4], GREEDY)
    for prompt, out in zip(PROMPTS[:4], outs):
        expected = hf_greedy(str(path), _ids(path, prompt), GREEDY["max_new_tokens"])
        assert out["output_ids"] == expected, prompt
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    engine.check_integrity()


@pytest.fixture(scope="module")
def llama_path(make_tiny_model):
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def alone(llama_path):
    engine = Engine(str(llama_path), dtype="float32")
    return {p: engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS}


def _batch16():
    return [PROMPTS[i % len(PROMPTS)] * (1 + i // len(PROMPTS)) for i in range(16)]


@pytest.fixture(scope="module")
def alone16(llama_path):
    engine = Engine(str(llama_path), dtype="float32")
    return [engine.generate(p, GREEDY)["output_ids"] for p in _batch16()]


def test_batch_of_16_equals_alone(llama_path, alone16):
    engine = Engine(str(llama_path), dtype="float32", debug_integrity=True)
    outs = engine.generate(_batch16(), GREEDY)
    assert [o["output_ids"] for o in outs] == alone16


@pytest.mark.parametrize("chunk", [4, 7, 32])
def test_chunked_prefill_equals_unchunked(llama_path, alone16, chunk):
    engine = Engine(str(llama_path), dtype="float32", chunked_prefill_size=chunk,
                    debug_integrity=True)
    outs = engine.generate(_batch16(), GREEDY)
    assert [o["output_ids"] for o in outs] == alone16


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_sizes(llama_path, alone, page_size):
    engine = Engine(str(llama_path), dtype="float32", page_size=page_size, debug_integrity=True)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in outs] == [alone[p] for p in PROMPTS]


def test_retraction_under_memory_pressure(llama_path, alone16):
    # 16 requests of up to ~80 tokens cannot all fit in 300 KV slots: the scheduler must
    # retract running requests to the waiting queue and resume them later.
    engine = Engine(str(llama_path), dtype="float32", max_total_tokens=300,
                    debug_integrity=True)
    outs = engine.generate(_batch16(), GREEDY)
    assert engine.get_server_info()["retractions"] > 0
    assert [o["output_ids"] for o in outs] == alone16


def test_forced_retraction_resumes_exactly(llama_path, alone):
    d = DirectScheduler(str(llama_path))
    rids = d.submit(PROMPTS[:3], GREEDY)
    for _ in range(6):  # prefill + a few decode steps
        d.step()
    victim = d.scheduler.running[1]
    d.scheduler.retract(victim)
    d.run()
    assert victim.retractions == 1
    assert d.output_ids(rids) == [alone[p] for p in PROMPTS[:3]]
    d.scheduler.check_integrity()


def test_new_requests_join_between_decode_steps(llama_path, alone):
    d = DirectScheduler(str(llama_path))
    first = d.submit(PROMPTS[0], GREEDY)
    for _ in range(4):
        d.step()
    assert len(d.scheduler.running) == 1
    second = d.submit(PROMPTS[1], GREEDY)
    saw_two = False
    while not all(b.finished for b in d.builders.values()):
        d.step()
        saw_two |= len(d.scheduler.running) == 2
    assert saw_two, "the second request never decoded alongside the first"
    assert d.output_ids(first + second) == [alone[PROMPTS[0]], alone[PROMPTS[1]]]

"""SGLang 0.5 frontend behaviours the DSL copies, on a fake backend (no engine): streamed
meta_info (output logprob lists per piece, `output_token_logprobs_length`), `forks[i] += ...`,
`global_config.default_backend` and a `Runtime`-shaped default backend."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest

import arborlm
import arborlm.lang as sgl
from arborlm.lang import stream_meta
from arborlm.lang.backends.base import BaseBackend
from arborlm.lang.choices import ChoicesDecision


def entry(i: int) -> list:
    return [-0.1 * i, i, None]


def chunk_meta(done: int, new: int, *, cumulative: bool = False) -> dict:
    """The meta_info of a chunk bringing tokens done..done+new-1, as a runtime streams it."""
    first = 0 if cumulative else done
    return {"completion_tokens": done + new, "output_token_logprobs_length": done + new,
            "output_token_logprobs": [entry(i) for i in range(first, done + new)],
            "input_token_logprobs": [[None, 1, None]] if done == 0 or cumulative else []}


def test_accumulate_adds_incremental_chunks_and_takes_cumulative_ones():
    for cumulative in (False, True):
        total = None
        for done, new in ((0, 2), (2, 0), (2, 3), (5, 1)):
            total = stream_meta.accumulate(total, chunk_meta(done, new, cumulative=cumulative))
        assert total["output_token_logprobs"] == [entry(i) for i in range(6)]
        assert total["output_token_logprobs_length"] == total["completion_tokens"] == 6
        assert total["input_token_logprobs"] == [[None, 1, None]]  # kept from the first


def test_accumulate_counts_entries_when_the_runtime_does_not():
    total = stream_meta.accumulate(None, {"output_token_logprobs": [entry(0)]})
    total = stream_meta.accumulate(total, {"output_token_logprobs": [entry(1)]})
    assert total["output_token_logprobs_length"] == 2


def test_since_reports_each_entry_once():
    total = stream_meta.accumulate(None, chunk_meta(0, 2))
    sent: dict[str, int] = {}
    assert len(stream_meta.since(total, sent)["output_token_logprobs"]) == 2
    stream_meta.accumulate(total, chunk_meta(2, 3))
    piece = stream_meta.since(total, sent)
    assert piece["output_token_logprobs"] == [entry(i) for i in range(2, 5)]
    assert piece["output_token_logprobs_length"] == 5


class ChunkBackend(BaseBackend):
    """Streams `chunks` — (text, new tokens) pairs — with SGLang-style meta_info; the chunks
    after the first wait until `release` is set, then come all at once."""

    def __init__(self, chunks: list[tuple[str, int]], cumulative: bool = False):
        self.chunks = chunks
        self.cumulative = cumulative
        self.release = threading.Event()

    def generate(self, s, params):
        text = "".join(t for t, _ in self.chunks)
        n = sum(k for _, k in self.chunks)
        return text, {**chunk_meta(0, n), "finish_reason": {"type": "length"}}

    def generate_stream(self, s, params):
        done = 0
        for i, (text, new) in enumerate(self.chunks):
            if i == 1:  # the reader sees the first piece, then several chunks at once
                self.release.wait(10)
            yield text, chunk_meta(done, new, cumulative=self.cumulative)
            done += new

    def select(self, s, choices, temperature, choices_method):
        return ChoicesDecision(choices[0])


@sgl.function
def qa(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", return_logprob=True))


CHUNKS = [("He", 1), ("llo", 2), ("", 1), (" wor", 1), ("", 0), ("ld", 2), (".", 1)]


@pytest.mark.parametrize("cumulative", [False, True])
def test_streamed_pieces_follow_sglang_logprob_semantics(cumulative):
    """SGLang's `test_stream_logprobs` invariant, with chunks that carry no text and chunks
    that arrive together while the reader waits."""
    backend = ChunkBackend(CHUNKS, cumulative)

    async def collect():
        state = qa.run(question="hi", backend=backend, stream=True)
        pieces = []
        async for text, meta in state.text_async_iter("answer", return_meta_data=True):
            pieces.append((text, meta))
            if len(pieces) == 1:
                backend.release.set()
                await asyncio.sleep(0.2)  # the rest of the stream arrives meanwhile
        return state, pieces

    state, pieces = asyncio.run(collect())
    assert "".join(t for t, _ in pieces) == "Hello world."
    prev = 0
    for text, meta in pieces:
        assert text
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev
        prev = meta["completion_tokens"]
    assert prev == 8
    whole = state.get_meta_info("answer")
    assert whole["output_token_logprobs"] == [entry(i) for i in range(8)]
    assert whole["input_token_logprobs"] == [[None, 1, None]]


def test_item_assignment_on_a_fork_group_appends_to_one_branch():
    backend = ChunkBackend([("x", 1)])

    @sgl.function
    def prog(s):
        s += "root "
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"branch {i}: "
            forks[i] += sgl.gen("out", max_tokens=4)
        forks.join()
        with pytest.raises(TypeError, match="cannot be replaced"):
            forks[0] = forks[1]

    state = prog.run(backend=backend)
    assert state["out"] == ["x"] * 3
    assert state.text() == "root "


def test_global_config_and_a_runtime_shaped_default_backend(monkeypatch):
    monkeypatch.setattr("arborlm.lang.program._default_backend", None)
    monkeypatch.setattr("arborlm.lang.program._default_backend_as_given", None)
    backend = ChunkBackend([("x", 1)])
    runtime = types.SimpleNamespace(endpoint=backend)  # the shape of SGLang's Runtime
    arborlm.set_default_backend(runtime)
    assert arborlm.global_config is sgl.global_config
    assert arborlm.global_config.default_backend is runtime
    assert arborlm.get_default_backend() is backend
    assert qa.run(question="hi")["answer"] == "x"
    with pytest.raises(AttributeError):
        arborlm.global_config.verbosity = 2  # SGLang's other settings are not ArborLM's

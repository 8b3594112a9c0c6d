"""Every example runs (in-process on the tiny model, and a few against the server) and does
what it says."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from tests.lang.conftest import grammar_supported

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def load(name: str):
        return importlib.import_module(name)

    return load


def test_quick_start(example, tiny_path):
    state = example("quick_start").main(["--model-path", str(tiny_path)])
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user",
                                                     "assistant"]
    assert state.get_meta_info("answer_1")["completion_tokens"] > 0


def test_json_extraction(example, tiny_path, engine_backend):
    state = example("json_extraction").main(["--model-path", str(tiny_path)])
    assert isinstance(state["person"], str)
    if grammar_supported(engine_backend):
        assert set(json.loads(state["person"])) == {"name", "age", "city"}


def test_multiple_choice(example, tiny_path):
    states = example("multiple_choice").main(["--model-path", str(tiny_path)])
    assert len(states) == 3
    assert [s["answer"] in [" " + o for o in q["options"]]
            for s, q in zip(states, example("multiple_choice").QUESTIONS)] == [True] * 3


def test_tree_of_thought(example, tiny_path):
    state = example("tree_of_thought").main(["--model-path", str(tiny_path)])
    assert len(state["plan"]) == 2 and [len(steps) for steps in state["step"]] == [2, 2]
    assert state["best"] in (" 1", " 2")


def test_react_agent(example, tiny_path):
    module = example("react_agent")
    state = module.main(["--model-path", str(tiny_path)])
    assert state.error() is None
    assert state.text().count("Action:") >= 1
    assert module.calculator("(12 + 30) * 3") == "126"
    assert module.calculator("__import__('os').getcwd()").startswith("error:")
    assert module.calculator("1/0").startswith("error:")


def test_streaming(example, tiny_path, monkeypatch):
    """The backend streams the story in several deltas, and `text_iter` yields it whole. How
    many pieces the example's loop sees depends on how far it lags the engine (`text_iter`
    yields everything new since its last piece: on a busy machine, the tiny model's 32 tokens
    can all arrive before the loop wakes), so the deltas are counted where they arrive."""
    from arborlm.lang.backends.native import NativeBackend

    calls: list[list[str]] = []  # the non-empty deltas of each streamed gen
    stream = NativeBackend.generate_stream

    def counting(self, s, params):
        calls.append([])
        for delta, chunk in stream(self, s, params):
            if delta:
                calls[-1].append(delta)
            yield delta, chunk

    monkeypatch.setattr(NativeBackend, "generate_stream", counting)
    pieces = example("streaming").main(["--model-path", str(tiny_path)])
    assert pieces and all(isinstance(p, str) for p in pieces)
    assert len(calls) == 2  # the story, then the asyncio one
    assert len(calls[0]) > 1
    assert "".join(pieces) == "".join(calls[0])


@pytest.mark.parametrize("name", ["quick_start", "multiple_choice", "tree_of_thought"])
def test_examples_against_the_server(example, server, name):
    result = example(name).main(["--url", server.url])
    states = result if isinstance(result, list) else [result]
    assert all(s.error() is None for s in states)

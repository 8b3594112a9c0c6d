"""Fixtures for the grammar tests: a real byte-level BPE tokenizer and both backends.

The tokenizer is the generated one of a tiny test model (`tiny_model(vocab_size=1024)`), so
the vocabulary has multi-character tokens such as `":` and ` "` that a grammar must split or
combine correctly, and real special tokens (<unk>, <s>, </s>, <pad>, chat markers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from arborlm.constrained import create_grammar_backend
from arborlm.constrained.base import GrammarBackend

VOCAB = 1024
EOS = 2


@pytest.fixture(scope="session")
def tokenizer(make_tiny_model: Any) -> Any:
    from transformers import AutoTokenizer

    path: Path = make_tiny_model("llama", vocab_size=VOCAB)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="session")
def backends(tokenizer: Any) -> dict[str, GrammarBackend]:
    return {name: create_grammar_backend(name, tokenizer, VOCAB, [EOS])
            for name in ("xgrammar", "outlines")}


@pytest.fixture(params=["xgrammar", "outlines"])
def backend(request: pytest.FixtureRequest, backends: dict[str, GrammarBackend]) -> GrammarBackend:
    return backends[request.param]


@pytest.fixture
def xgrammar(backends: dict[str, GrammarBackend]) -> GrammarBackend:
    return backends["xgrammar"]

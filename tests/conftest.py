"""Shared test fixtures: the model cache location and the generated test models.

Generated models and tokenizers are cached under `$ARBORLM_CACHE_DIR`; unless the caller sets
it, the test session uses `<repo>/.cache/` (git-ignored), so models are built once per checkout
and reused by every later test run and worker process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("ARBORLM_CACHE_DIR", str(REPO_ROOT / ".cache"))

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def make_tiny_model() -> Callable[..., Path]:
    """`make_tiny_model(arch="llama", **overrides) -> Path`: a cached tiny checkpoint."""
    from arborlm.runtime.models.factory import tiny_model

    def make(arch: str = "llama", **overrides: Any) -> Path:
        return tiny_model(arch, **overrides)

    return make


@pytest.fixture(params=ARCHS)
def tiny_model_path(request: pytest.FixtureRequest, make_tiny_model: Callable[..., Path]) -> Path:
    """A tiny checkpoint of each architecture in `ARCHS` (the test runs once per arch)."""
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The built-in default model (32,000-token vocabulary), built on first use."""
    from arborlm.runtime.models.factory import default_model_path

    return default_model_path()

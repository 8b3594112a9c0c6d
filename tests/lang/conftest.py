"""Fixtures for the frontend-language tests: backends on a tiny model, in-process and over HTTP.

`engine_backend` is an `EngineBackend` on the tiny Llama (one per session). `server` starts a
real `python -m arborlm.server` on the same model (one per session, only when a test needs it;
skipped when this checkout has no server). `backend` runs a test once per backend. Program
tests run greedy unless they say otherwise, so their outputs are reproducible.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="session")
def tiny_path(make_tiny_model: Any) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def engine_backend(tiny_path: Path) -> Iterator[Any]:
    from arborlm.lang.backends.engine_backend import EngineBackend

    # float32: the tests compare batched greedy text with each prompt run alone, and only
    # float32 keeps that exact (dtype auto is bfloat16 on CPUs with native bfloat16).
    backend = EngineBackend(model_path=str(tiny_path), dtype="float32")
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session")
def server(tiny_path: Path) -> Iterator[Any]:
    if not (REPO_ROOT / "arborlm" / "server" / "__main__.py").is_file():
        pytest.skip("this checkout has no HTTP server (arborlm/server/__main__.py)")
    from tests.server.server_process import running_server

    with running_server(tiny_path, "--dtype", "float32") as proc:
        yield proc


@pytest.fixture(scope="session")
def endpoint_backend(server: Any) -> Iterator[Any]:
    from arborlm.lang.backends.runtime_endpoint import RuntimeEndpoint

    backend = RuntimeEndpoint(server.url)
    yield backend
    backend.shutdown()


@pytest.fixture(params=["engine", "endpoint"])
def backend(request: pytest.FixtureRequest) -> Any:
    """Each backend in turn: the in-process engine, then the HTTP server."""
    return request.getfixturevalue(f"{request.param}_backend")


_GRAMMAR_PROBE: dict[int, bool] = {}


def grammar_supported(backend: Any) -> bool:
    """Whether the runtime enforces `regex` (a probe request whose output must match)."""
    key = id(backend)
    if key not in _GRAMMAR_PROBE:
        out = backend.request({"text": "Say it:", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "regex": "(zq){3}"}})
        _GRAMMAR_PROBE[key] = out["text"] == "zqzqzq"
    return _GRAMMAR_PROBE[key]


def require_grammar(backend: Any) -> None:
    if not grammar_supported(backend):
        pytest.skip("the runtime does not enforce regex / json_schema yet (grammar support "
                    "absent: the probe's output did not match its regex)")

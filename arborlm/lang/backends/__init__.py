"""Backends the frontend language runs programs on.

- `RuntimeEndpoint(url, api_key=None)`: an ArborLM server (or any server with the same native
  API) over HTTP.
- `EngineBackend(engine)`: an `arborlm.Engine` in this process (`set_default_backend` also
  accepts an `Engine` directly and wraps it).
- `OpenAI(model, base_url=..., api_key=...)`: any OpenAI-compatible server (gen and chat roles).

Each is imported on first use, so importing the language loads neither HTTP clients nor the
engine.
"""

from typing import Any

from arborlm.lang.backends.base import BaseBackend

__all__ = ["BaseBackend", "EngineBackend", "OpenAI", "RuntimeEndpoint"]

_LAZY = {
    "RuntimeEndpoint": "arborlm.lang.backends.runtime_endpoint",
    "EngineBackend": "arborlm.lang.backends.engine_backend",
    "OpenAI": "arborlm.lang.backends.openai_backend",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'arborlm.lang.backends' has no attribute {name!r}")

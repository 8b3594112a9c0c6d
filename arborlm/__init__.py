"""ArborLM: a structured-generation runtime for LLM programs.

`import arborlm` stays light: it does not import FastAPI, Triton or FlashInfer, and it loads the
engine only when `arborlm.Engine` is first used.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["Engine", "EngineArgs", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from arborlm.runtime.engine import Engine

        return Engine
    if name == "EngineArgs":
        from arborlm.runtime.config import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'arborlm' has no attribute {name!r}")

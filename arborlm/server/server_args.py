"""`ServerArgs`: the HTTP server's own options (the engine's are `EngineArgs`).

One frozen dataclass; each field's `help` metadata is its CLI help text (see `cli.py`), so an
option is documented once. Names follow SGLang's server arguments where SGLang has one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from arborlm.server.limits import (
    DRAIN_TIMEOUT_S,
    KEEP_ALIVE_S,
    MAX_QUEUED_REQUESTS,
    MAX_REQUEST_BYTES,
)

ENGINE_MODES = ("multiprocess", "inprocess")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


def default_engine_mode() -> str:
    """`multiprocess` (scheduler and detokenizer in child processes) when this checkout has the
    multi-process client, else `inprocess` (scheduler on a thread of the API process)."""
    found = importlib.util.find_spec("arborlm.runtime.multiprocess_client") is not None
    return "multiprocess" if found else "inprocess"


@dataclass(frozen=True)
class ServerArgs:
    host: str = _doc("Address to listen on.", default="127.0.0.1")
    port: int = _doc("Port to listen on; 0 picks a free one (the ready line shows it).",
                     default=30000)
    api_key: str | None = _doc(
        "Require `Authorization: Bearer KEY` on every route except /health and /metrics.",
        default=None)
    served_model_name: str | None = _doc(
        "Model name reported by /v1/models and OpenAI responses; default: the model path.",
        default=None)
    chat_template: str | None = _doc(
        "Chat template for /v1/chat/completions: a Jinja file path or a template string; "
        "default: the tokenizer's.", default=None)
    engine_mode: str = _doc(
        "Where the scheduler runs: multiprocess (child processes, the default when available) "
        "or inprocess (a thread of the server process).", default_factory=default_engine_mode)
    max_queued_requests: int = _doc(
        "Sequences that may wait beyond --max-running-requests; more are answered 503 with "
        "Retry-After.", default=MAX_QUEUED_REQUESTS)
    max_request_bytes: int = _doc("Largest accepted request body in bytes (413 above).",
                                  default=MAX_REQUEST_BYTES)
    drain_timeout: float = _doc(
        "Seconds SIGTERM waits for in-flight requests to finish before exiting.",
        default=DRAIN_TIMEOUT_S)
    timeout_keep_alive: int = _doc(
        "Seconds an idle keep-alive connection stays open; keep it above the clients' pool "
        "expiry (httpx and openai: 5 s, aiohttp: 15 s), or a request sent on a connection the "
        "server is closing gets no answer.", default=KEEP_ALIVE_S)
    engine_restart_attempts: int = _doc(
        "When the scheduler or detokenizer process dies (multiprocess mode), fail the requests "
        "in flight, answer 503 \"engine restarting\" with Retry-After, and start both again: "
        "up to this many failed starts in a row (0.5 s before the first, doubling up to 8 s), "
        "then exit with status 3. 0: exit with status 3 when one dies.", default=5)
    log_level: str = _doc("Log level: debug, info, warning, error, critical.", default="info")

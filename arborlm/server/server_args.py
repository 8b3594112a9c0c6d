"""`ServerArgs`: the HTTP server's own options (the engine's are `EngineArgs`).

One frozen dataclass; each field's `help` metadata is its CLI help text (see `cli.py`), so an
option is documented once. Names follow SGLang's server arguments where SGLang has one. Options
with a fixed set of values name their `StrEnum` (`LogLevel` here; `EngineMode` with the
engine's in `arborlm.runtime.config`), which the CLI's `choices=` reads. This module imports the
engine's configuration module (and so torch); `cli.py` imports it only when it parses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from arborlm.runtime.config import EngineMode, option
from arborlm.server.limits import (
    DRAIN_TIMEOUT_S,
    KEEP_ALIVE_S,
    MAX_QUEUED_REQUESTS,
    MAX_REQUEST_BYTES,
)


class LogLevel(enum.StrEnum):
    """The server's log level (Python's logging levels, lower-case)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


@dataclass(frozen=True)
class ServerArgs:
    host: str = option("Address to listen on.", default="127.0.0.1")
    port: int = option("Port to listen on; 0 picks a free one (the ready line shows it).",
                       default=30000)
    api_key: str | None = option(
        "Require `Authorization: Bearer KEY` on every route except /health and /metrics.",
        default=None)
    served_model_name: str | None = option(
        "Model name reported by /v1/models and OpenAI responses; default: the model path.",
        default=None)
    chat_template: str | None = option(
        "Chat template for /v1/chat/completions: a Jinja file path or a template string; "
        "default: the tokenizer's.", default=None)
    engine_mode: str = option(
        "Where the scheduler runs: multiprocess (child processes) or inprocess (a thread of the "
        "server process).", default=EngineMode.MULTIPROCESS.value)
    max_queued_requests: int = option(
        "Sequences that may wait beyond --max-running-requests; more are answered 503 with "
        "Retry-After.", default=MAX_QUEUED_REQUESTS)
    max_request_bytes: int = option("Largest accepted request body in bytes (413 above).",
                                    default=MAX_REQUEST_BYTES)
    drain_timeout: float = option(
        "Seconds SIGTERM waits for in-flight requests to finish before exiting.",
        default=DRAIN_TIMEOUT_S)
    timeout_keep_alive: int = option(
        "Seconds an idle keep-alive connection stays open; keep it above the clients' pool "
        "expiry (httpx and openai: 5 s, aiohttp: 15 s), or a request sent on a connection the "
        "server is closing gets no answer.", default=KEEP_ALIVE_S)
    engine_restart_attempts: int = option(
        "When the scheduler or detokenizer process dies (multiprocess mode), fail the requests "
        "in flight, answer 503 \"engine restarting\" with Retry-After, and start both again: "
        "up to this many failed starts in a row (0.5 s before the first, doubling up to 8 s), "
        "then exit with status 3. 0: exit with status 3 when one dies.", default=5)
    dp_size: int = option(
        "Data parallelism: engine replicas (each its own scheduler and detokenizer processes, "
        "KV pool and radix cache) behind this server, each request routed to one by "
        "--load-balance-method; multiprocess mode only.", default=1)
    load_balance_method: str = option(
        "How --dp-size replicas are chosen: cache_aware (the replica that served the longest "
        "prefix, shortest queue when the load is imbalanced), round_robin, shortest_queue "
        "(minimum_tokens: the same).", default="cache_aware")
    log_level: str = option("Log level.", default=LogLevel.INFO.value)

"""The server's named limits and its admission gate (the bounded waiting queue).

Every limit the HTTP edge enforces has a name here, with the error it raises when exceeded, so
that a client hitting one learns which limit and by how much. The engine enforces its own
limits too (prompt length against the context, sampling ranges, `n`, stop-string count); these
constants reuse the engine's where the two must agree. This module does not know about HTTP
status codes beyond the `Overloaded` signal the routes turn into 503.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from arborlm.errors import ArborLMError, InvalidRequestError
from arborlm.runtime.generate_request import MAX_BATCH, MAX_TOP_LOGPROBS
from arborlm.runtime.sampling_params import MAX_N, MAX_STOP_STRINGS

# A request body larger than this is answered 413 before it is parsed.
MAX_REQUEST_BYTES = 2 * 1024 * 1024
# An oversized body up to this size is read and discarded before the 413, so that a client still
# writing its body sees the answer instead of a reset connection; a larger one is cut off.
MAX_DISCARD_BYTES = 64 * 1024 * 1024
# Sequences (prompts x n) that may wait for a running slot, beyond --max-running-requests.
MAX_QUEUED_REQUESTS = 1024
# Seconds an overloaded client is asked to wait before retrying (the Retry-After header).
RETRY_AFTER_S = 1
# Seconds SIGTERM waits for in-flight requests before the server exits anyway.
DRAIN_TIMEOUT_S = 30.0
# Seconds an idle keep-alive connection stays open: longer than clients keep idle connections
# pooled (httpx and the openai client 5 s, aiohttp 15 s). At uvicorn's default (5 s) a client
# could send a request on a connection the server was just closing, and get nothing back.
KEEP_ALIVE_S = 75
# Seconds /health_generate waits for its one-token generation.
HEALTH_GENERATE_TIMEOUT_S = 20.0
# OpenAI's own bound on `top_logprobs` (chat) and `logprobs` (completions).
MAX_OPENAI_TOP_LOGPROBS = 20
# Token ids accepted by /detokenize in one request.
MAX_DETOKENIZE_TOKENS = 1_000_000

__all__ = [
    "DRAIN_TIMEOUT_S", "HEALTH_GENERATE_TIMEOUT_S", "KEEP_ALIVE_S", "MAX_BATCH",
    "MAX_DETOKENIZE_TOKENS", "MAX_DISCARD_BYTES", "MAX_N", "MAX_OPENAI_TOP_LOGPROBS",
    "MAX_QUEUED_REQUESTS", "MAX_REQUEST_BYTES", "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS",
    "RETRY_AFTER_S", "AdmissionGate", "Overloaded", "check_max_new_tokens",
]


class Overloaded(ArborLMError):
    """The waiting queue is full; the client should retry after `RETRY_AFTER_S` seconds."""


def check_max_new_tokens(value: int, context_length: int, param: str = "max_new_tokens") -> None:
    """A generation can never be longer than the context, so a larger ask is a client error.

    (Asks that fit the context but not next to the prompt are shortened by the engine, which
    then finishes with `length`, as vLLM and SGLang do.)
    """
    if value > context_length:
        raise InvalidRequestError(
            f"{param} must be <= the model's context length ({context_length}), got {value}",
            param)


@dataclass
class AdmissionGate:
    """Counts the sequences the server has in flight and refuses more than it may queue.

    `capacity` is the engine's running slots plus the waiting-queue bound; `admit(n)` takes `n`
    slots or raises `Overloaded`, and `release(n)` gives them back. Thread-safe, O(1).
    """

    capacity: int

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0

    def admit(self, n: int) -> None:
        if n > self.capacity:
            raise InvalidRequestError(
                f"the request asks for {n} sequences (prompts x n) but the server holds at most "
                f"{self.capacity} at once (--max-running-requests + --max-queued-requests)", "n")
        with self._lock:
            if self.in_flight + n > self.capacity:
                raise Overloaded(
                    f"the server is overloaded: {self.in_flight} sequences in flight, "
                    f"{n} more asked, at most {self.capacity} (running + queued); retry later")
            self.in_flight += n

    def release(self, n: int) -> None:
        with self._lock:
            assert self.in_flight >= n, (self.in_flight, n)
            self.in_flight -= n

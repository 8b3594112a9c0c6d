"""Errors the frontend language raises to the program's caller.

`ProgramError` is what a caller sees when a program failed: reading a variable the failed
program never produced, iterating a failed stream, or a failed `run_batch` entry read later. Its
`__cause__` is the original exception (a backend error, or an exception in the program's own
Python code). `BackendError` is a failure reported by a backend: an HTTP error, a request the
engine aborted, or an operation the backend cannot do.
"""

from __future__ import annotations

from arborlm.errors import ArborLMError


class ProgramError(ArborLMError):
    """A program failed; `__cause__` holds the exception that stopped it."""


class BackendError(ArborLMError):
    """A backend could not serve a call (HTTP error, aborted request, unsupported operation).

    `status_code` is the HTTP status (or the abort's status code) when there is one.
    """

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code

"""Typed exceptions shared by every layer of ArborLM.

Validation errors raised at the edges (Engine API, HTTP) derive from `InvalidRequestError` and
become 400 responses; load-time problems derive from `ModelLoadError`. Internal invariants use
`assert`, not these classes.
"""


class ArborLMError(Exception):
    """Base class of every error ArborLM raises on purpose."""


class InvalidRequestError(ArborLMError, ValueError):
    """The caller asked for something invalid (bad prompt, out-of-range sampling value, ...).

    `param` names the offending field when there is one, so the HTTP layer can report it.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(ArborLMError):
    """A model directory is missing, incomplete, or of an unsupported architecture."""


class OutOfMemoryError(ArborLMError):
    """The KV pool cannot hold even a single request of the asked size."""


class EngineDeadError(ArborLMError):
    """A child process of the engine died; pending and future calls fail with this."""


class EngineRestartingError(EngineDeadError):
    """The engine's processes died and are being started again; retry after `retry_after_s`.

    Calls pending when the engine died end with this error, and calls made until it serves
    again raise it at once. The message starts with "engine restarting".
    """

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GrammarError(InvalidRequestError):
    """A grammar (JSON schema, regex, EBNF, choices) is invalid, unsupported, or timed out."""


class MessageDecodeError(ArborLMError, ValueError):
    """Bytes received on an engine socket are not an encoded message of this ArborLM version."""

"""`BaseBackend`: what the interpreter needs from a model server.

A backend turns one primitive of a running program into requests: `generate` (a `gen`),
`generate_stream` (a `gen` of a streaming run), `select` (score the choices), `cache_prefix`
(prefill a prompt so later requests share it: `fork` and `run_batch` use it). Each receives the
program's executor `s`, whose `text_` is the prompt so far and `messages_` the chat so far.
Backends are shared by every program and branch running at once, so their methods must be
safe to call from many threads. The implementations: `RuntimeEndpoint` (HTTP, native API),
`EngineBackend` (an in-process `arborlm.Engine`), `OpenAI` (any OpenAI-compatible server).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from arborlm.lang.chat_template import ChatTemplate, get_chat_template
from arborlm.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from arborlm.lang.errors import BackendError
from arborlm.lang.ir import GenParams

if TYPE_CHECKING:
    from arborlm.lang.interpreter import StreamExecutor


class BaseBackend(abc.ABC):
    #: Whether `gen` needs a chat (messages) request rather than a text completion.
    is_chat_model: bool = False
    chat_template: ChatTemplate = get_chat_template("default")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    @abc.abstractmethod
    def generate(self, s: StreamExecutor, params: GenParams) -> tuple[str, dict[str, Any]]:
        """Generate a continuation of `s`; returns (text, meta_info)."""

    @abc.abstractmethod
    def generate_stream(self, s: StreamExecutor,
                        params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Generate a continuation of `s` piece by piece: (new text, the chunk's meta_info).

        A chunk's output logprob lists may hold only its new entries, as SGLang streams them
        (`output_token_logprobs_length` then counts all so far); the executor adds the chunks
        up (`arborlm.lang.stream_meta`)."""

    @abc.abstractmethod
    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Score each choice as a continuation of `s` and let `choices_method` decide."""

    def cache_prefix(self, prefix: str) -> None:  # noqa: B027 - optional hook
        """Prefill `prefix` so that later requests starting with it hit the prefix cache.

        Backends with no prefill-only request (the OpenAI API) have nothing to warm and keep
        this default, which does nothing.
        """

    def end_program(self, s: StreamExecutor) -> None:  # noqa: B027 - optional hook
        """Called when a program (or branch) finishes; backends keep no per-program state."""

    def get_model_name(self) -> str:
        """The model's path or name (what SGLang's backends report)."""
        raise BackendError(f"{type(self).__name__} does not know its model's name")

    def flush_cache(self) -> bool:
        raise BackendError(f"{type(self).__name__} cannot flush a prefix cache")

    def get_server_info(self) -> dict[str, Any]:
        raise BackendError(f"{type(self).__name__} reports no server information")

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend started (an owned engine, HTTP sessions)."""

    def __enter__(self) -> BaseBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

"""`EngineBackend`: programs run against an `arborlm.Engine` in this process.

Every program state and forked branch calls the engine from its own worker thread;
`Engine.generate` is thread-safe and the engine's scheduler thread batches concurrent callers,
so independent programs share forward passes exactly as they would behind a server. Streaming
drives `Engine.async_generate(stream=True)` on a private event loop of the calling thread.

The chat template is the model's own (derived from the engine's tokenizer), else the registry's
guess from the model path. This module imports the engine only when it builds one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from arborlm.lang.backends.native import NativeBackend
from arborlm.lang.chat_template import (
    ChatTemplate,
    get_chat_template,
    get_chat_template_by_model_path,
)
from arborlm.lang.model_template import chat_template_from_tokenizer

_GENERATE_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                  "return_text_in_logprobs", "rid", "extra_key", "priority")


class EngineBackend(NativeBackend):
    def __init__(self, engine: Any = None, *, model_path: str | None = None,
                 chat_template: str | ChatTemplate | None = None, **engine_options: Any):
        """Wrap `engine` (an `arborlm.Engine`), or start one from `model_path` (None: the
        built-in default model) and `engine_options`; a started engine is shut down by
        `shutdown()`."""
        self._owns_engine = engine is None
        if engine is None:
            from arborlm.runtime.engine import Engine

            engine = Engine(model_path, **engine_options)
        elif model_path is not None or engine_options:
            raise ValueError("pass either an engine or the options to start one, not both")
        self.engine = engine
        self.model_path = str(engine.config.model.path)
        self.prefix_cache_enabled = not engine.args.disable_radix_cache
        self.chat_template = _pick_template(chat_template, engine.tokenizer, self.model_path)

    def request(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        return self.engine.generate(payload.get("text"), payload.get("sampling_params"),
                                    payload.get("input_ids"), **_extra(payload))

    def request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        loop = asyncio.new_event_loop()
        agen = None
        try:
            agen = loop.run_until_complete(self.engine.async_generate(
                payload.get("text"), payload.get("sampling_params"), payload.get("input_ids"),
                stream=True, **_extra(payload)))
            while True:
                try:
                    yield loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if agen is not None:
                loop.run_until_complete(agen.aclose())
            loop.close()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        from arborlm.runtime.tokenizer_utils import encode

        return [encode(self.engine.tokenizer, t) for t in texts]

    def flush_cache(self) -> bool:
        ok, _ = self.engine.flush_cache()
        return ok

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()


def _extra(payload: dict[str, Any]) -> dict[str, Any]:
    return {k: payload[k] for k in _GENERATE_KEYS if k in payload}


def _pick_template(choice: str | ChatTemplate | None, tokenizer: Any,
                   model_path: str) -> ChatTemplate:
    if isinstance(choice, ChatTemplate):
        return choice
    if choice is not None:
        return get_chat_template(choice)
    return chat_template_from_tokenizer(tokenizer) or get_chat_template_by_model_path(model_path)

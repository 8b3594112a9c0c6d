"""`Engine`: ArborLM's one generation API.

`Engine(model_path=None, **options)` loads a model (None = SmolLM2-135M-Instruct,
fetched once into the cache; see `models/builtin.py`) and
serves `generate(...)` (blocking) and `async_generate(...)` (awaitable, or an async iterator of
chunks with `stream=True`), returning the native API's response shape (`text`, `output_ids`,
`meta_info`). Option names follow SGLang's server arguments (see `EngineArgs`).

`mode="inprocess"` (default) runs the scheduler on a background thread of this process;
`mode="multiprocess"` runs it, and the detokenizer, in child processes over ZeroMQ (the server's
setup). Both run the same scheduler code behind the same `EngineClient` interface.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from arborlm.errors import InvalidRequestError
from arborlm.runtime import schema_report
from arborlm.runtime.config import EngineArgs, EngineMode, check_choice
from arborlm.runtime.engine_client import EngineClient
from arborlm.runtime.generate_request import GenerateRequest


def make_engine_args(model_path: str | None, options: dict[str, Any]) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise InvalidRequestError(f"unknown engine option(s): {', '.join(unknown)}", unknown[0])
    return EngineArgs(model_path=model_path, **options)


def create_client(args: EngineArgs, mode: str, **options: Any) -> EngineClient:
    """The engine client for `mode`; `options` go to the multi-process client (its restart
    policy, see `MultiProcessClient`)."""
    if check_choice(EngineMode, mode, "mode") == EngineMode.INPROCESS:
        from arborlm.runtime.inprocess_client import InProcessClient

        return InProcessClient(args)
    from arborlm.runtime.multiprocess_client import MultiProcessClient

    return MultiProcessClient(args, **options)


class Engine:
    def __init__(self, model_path: str | None = None, *, mode: str = EngineMode.INPROCESS.value,
                 **options: Any):
        self.args = make_engine_args(model_path, options)
        self.mode = mode
        self.client = create_client(self.args, mode)
        self.config = self.client.config
        self.tokenizer = self.client.tokenizer

    # --- generation ---------------------------------------------------------------------------

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 **kwargs: Any) -> dict | list[dict]:
        """Generate for one prompt (a dict back) or a batch / `n > 1` (a list back).

        kwargs: return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob,
        return_text_in_logprobs, rid, extra_key, priority (as in the native API).
        """
        req = self._request(prompt, sampling_params, input_ids, False, kwargs)
        return self._shape(req, self._reported(req, self.client.generate_sync(req)))

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, *,
                             stream: bool = False, **kwargs: Any) -> Any:
        """Awaitable result, or with `stream=True` an async iterator of chunks (cumulative
        `text`, new logprob entries only; each chunk has `index` for batches / n > 1)."""
        req = self._request(prompt, sampling_params, input_ids, stream, kwargs)
        if stream:
            return self._stream(req)
        return self._shape(req, self._reported(req, await self.client.generate_all(req)))

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        events = schema_report.attach(self.client.generate(req), req, self.args.grammar_backend)
        async for index, event in events:
            yield {**event, "index": index}

    def _reported(self, req: GenerateRequest, results: list[dict]) -> list[dict]:
        """`results` with the report of each non-strict JSON schema (`schema_report`)."""
        return schema_report.annotate_results(results, req, self.args.grammar_backend)

    def _request(self, prompt: Any, sampling_params: Any, input_ids: Any, stream: bool,
                 kwargs: dict[str, Any]) -> GenerateRequest:
        allowed = {"return_logprob", "logprob_start_len", "top_logprobs_num",
                   "token_ids_logprob", "return_text_in_logprobs", "rid", "extra_key",
                   "priority"}
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise InvalidRequestError(f"unknown generate argument(s): {', '.join(unknown)}",
                                      unknown[0])
        return GenerateRequest(text=prompt, input_ids=input_ids, sampling_params=sampling_params,
                               stream=stream, **kwargs)

    @staticmethod
    def _shape(req: GenerateRequest, results: list[dict]) -> dict | list[dict]:
        return results if req.is_batch or len(results) != 1 else results[0]

    # --- control ------------------------------------------------------------------------------

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.client.abort(rid, abort_all)

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache; refused (False, reason) while requests are pending."""
        return _run(self.client.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return _run(self.client.server_info())

    @property
    def scheduler(self) -> Any:
        """The scheduler object (in-process mode only; for tests and tools)."""
        return self.client.scheduler  # type: ignore[attr-defined]

    def check_integrity(self) -> None:
        """KV/cache invariants when idle (in-process: checked on the scheduler thread)."""
        if self.mode == EngineMode.INPROCESS:
            self.client.call(self.scheduler.check_integrity)  # type: ignore[attr-defined]
        else:
            info = self.get_server_info()
            if not info.get("integrity_ok", False):
                raise AssertionError(f"KV integrity check failed: {info.get('integrity')}")

    def healthy(self) -> bool:
        return self.client.healthy()

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            try:
                client.shutdown()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def _run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)

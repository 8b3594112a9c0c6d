"""`Engine`: ArborLM's one generation API.

`Engine(model_path=None, **options)` loads a model (None = the built-in default model) and
serves `generate(...)` calls, returning the native API's response shape (`text`, `output_ids`,
`meta_info`). Option names follow SGLang's server arguments (see `EngineArgs`). This module runs
the scheduler in the caller's process; the multi-process runtime reuses the same pieces
(`GenerateRequest`, `Scheduler`, `ResponseBuilder`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

from arborlm.errors import InvalidRequestError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.generate_request import GenerateRequest, SingleRequest, validate_single
from arborlm.runtime.request import Req
from arborlm.runtime.response import ResponseBuilder
from arborlm.runtime.scheduler.scheduler import Scheduler
from arborlm.runtime.tokenizer_utils import encode, load_tokenizer

logger = logging.getLogger(__name__)


def make_engine_args(model_path: str | None, options: dict[str, Any]) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise InvalidRequestError(f"unknown engine option(s): {', '.join(unknown)}", unknown[0])
    return EngineArgs(model_path=model_path, **options)


class Engine:
    def __init__(self, model_path: str | None = None, **options: Any):
        self.args = make_engine_args(model_path, options)
        self.config = self.args.resolve()
        self.tokenizer = load_tokenizer(self.config.tokenizer_path)
        self.scheduler = Scheduler(self.config, self.tokenizer)
        self._seeds = random.Random(self.args.random_seed)

    # --- public API ---------------------------------------------------------------------------

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *,
                 return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] = -1,
                 top_logprobs_num: int | list[int] = 0,
                 token_ids_logprob: list[int] | list[list[int]] | None = None,
                 return_text_in_logprobs: bool = False,
                 rid: str | list[str] | None = None,
                 extra_key: str | list[str] | None = None) -> dict | list[dict]:
        """Generate for one prompt (a dict back) or a batch / `n > 1` (a list back)."""
        request = GenerateRequest(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, token_ids_logprob=token_ids_logprob,
            return_text_in_logprobs=return_text_in_logprobs, extra_key=extra_key)
        singles = request.normalize()
        builders = self._submit(singles)
        self._run_until_done(builders)
        results = [b.result() for b in builders.values()]
        if request.is_batch or len(results) > 1:
            return results
        return results[0]

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache; refused (False, reason) while requests are pending."""
        return self.scheduler.flush_cache()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def get_server_info(self) -> dict[str, Any]:
        return self.scheduler.server_info()

    def shutdown(self) -> None:
        self.scheduler = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- internals ----------------------------------------------------------------------------

    def tokenize(self, req: SingleRequest) -> list[int]:
        ids = req.input_ids if req.input_ids is not None else encode(self.tokenizer, req.text)
        validate_single(req, ids, context_length=self.config.model.context_length,
                        max_total_tokens=self.scheduler.max_total_tokens,
                        vocab_size=self.config.model.vocab_size)
        return ids

    def make_req(self, single: SingleRequest, ids: list[int]) -> Req:
        seed = single.sampling_params.sampling_seed
        return Req(single.rid, ids, single.sampling_params,
                   return_logprob=single.return_logprob,
                   logprob_start_len=single.logprob_start_len,
                   top_logprobs_num=single.top_logprobs_num,
                   token_ids_logprob=single.token_ids_logprob, extra_key=single.extra_key,
                   seed=seed if seed is not None else self._seeds.getrandbits(62),
                   priority=single.priority, stream=single.stream)

    def _submit(self, singles: list[SingleRequest]) -> dict[str, ResponseBuilder]:
        tokenized = [(s, self.tokenize(s)) for s in singles]  # validate all before queueing any
        builders: dict[str, ResponseBuilder] = {}
        for single, ids in tokenized:
            builders[single.rid] = ResponseBuilder(single, self.tokenizer, ids)
            self.scheduler.add_request(self.make_req(single, ids))
        return builders

    def _run_until_done(self, builders: dict[str, ResponseBuilder]) -> None:
        pending = set(builders)
        while pending:
            outputs = self.scheduler.step()
            for out in outputs:
                b = builders.get(out.rid)
                if b is None:
                    continue
                b.add(out)
                if b.finished:
                    pending.discard(out.rid)
            if not outputs and self.scheduler.is_idle and pending:
                raise RuntimeError(f"scheduler went idle with requests pending: {pending}")
        if self.args.debug_integrity and self.scheduler.is_idle:
            self.scheduler.check_integrity()

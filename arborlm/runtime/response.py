"""`ResponseBuilder`: one request's scheduler reports -> the native API's response JSON.

Owns the request's incremental detokenizer (cumulative text, stop-string trimming, UTF-8
boundaries) and its logprob lists. `result()` is the final object; `chunk()` is a streaming
event whose `text` / `output_ids` are cumulative and whose logprob lists hold only what is new
since the previous chunk. A request that is not streamed has its text read only at the end, so
its ids are detokenized then, in one call, instead of one call per step on the scheduler's
thread (the detokenizer gives the same text however the ids are split).
"""

from __future__ import annotations

import time
from typing import Any

from arborlm.runtime.detokenizer import IncrementalDetokenizer
from arborlm.runtime.generate_request import SingleRequest
from arborlm.runtime.scheduler.outputs import ReqOutput
from arborlm.runtime.stop_matcher import finish_text

_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                 "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")


class ResponseBuilder:
    def __init__(self, req: SingleRequest, tokenizer: Any, prompt_ids: list[int]):
        self.req = req
        self.tokenizer = tokenizer
        p = req.sampling_params
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_ids=prompt_ids, skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens, stop=list(p.stop),
            no_stop_trim=p.no_stop_trim)
        self.start = time.monotonic()
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {"id": req.rid, "finish_reason": None, "prompt_tokens":
                                     len(prompt_ids), "completion_tokens": 0, "cached_tokens": 0}
        self.logprobs: dict[str, list] = {k: [] for k in _LOGPROB_KEYS}
        self._sent = {k: 0 for k in _LOGPROB_KEYS}
        self.finished = False
        self.text = ""
        self._deferred: list[int] | None = None if req.stream else []  # ids not yet detokenized

    def add(self, out: ReqOutput) -> None:
        self.output_ids.extend(out.new_token_ids)
        if self._deferred is None:
            if out.finished_reason is None:
                self.detok.add(out.new_token_ids)
            else:
                self._deferred = list(out.new_token_ids)  # fed by `_finish`
        else:
            self._deferred.extend(out.new_token_ids)
        self.meta.update(completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
                         prompt_tokens=out.prompt_tokens)
        if out.jump_forward_steps:
            self.meta["jump_forward_steps"] = out.jump_forward_steps
        if self.req.return_logprob:
            lp = self.logprobs
            lp["output_token_logprobs"].extend(self._entries(out.output_token_logprobs))
            lp["output_top_logprobs"].extend(self._nested(out.output_top_logprobs))
            lp["output_token_ids_logprobs"].extend(self._nested(out.output_token_ids_logprobs))
            if out.input_token_logprobs is not None:
                lp["input_token_logprobs"].extend(self._entries(out.input_token_logprobs))
                lp["input_top_logprobs"].extend(self._nested(out.input_top_logprobs or []))
                lp["input_token_ids_logprobs"].extend(
                    self._nested(out.input_token_ids_logprobs or []))
        if out.finished_reason is not None:
            self._finish(out.finished_reason)
        elif self._deferred is None:
            self.text = self.detok.text

    def _finish(self, reason: dict[str, Any]) -> None:
        self.finished = True
        p = self.req.sampling_params
        self.text = finish_text(
            self.detok, self._deferred or [], reason, stop=p.stop, stop_regex=p.stop_regex,
            no_stop_trim=p.no_stop_trim, min_new_tokens=p.min_new_tokens,
            completion_tokens=len(self.output_ids))
        self._deferred = []
        self.meta["finish_reason"] = reason
        self.meta["e2e_latency"] = round(time.monotonic() - self.start, 6)

    def _text_of(self, token_id: int) -> str | None:
        if not self.req.return_text_in_logprobs:
            return None
        return self.tokenizer.decode([token_id])

    def _entries(self, pairs: list) -> list[list]:
        return [[lp, tid, self._text_of(tid)] for lp, tid in pairs]

    def _nested(self, rows: list) -> list:
        return [None if row is None else self._entries(row) for row in rows]

    def result(self) -> dict[str, Any]:
        meta = dict(self.meta)
        if self.req.return_logprob:
            meta.update({k: list(v) for k, v in self.logprobs.items()})
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def chunk(self) -> dict[str, Any]:
        """A streaming event: cumulative text and ids, logprob entries new since the last one."""
        meta = dict(self.meta)
        if self.req.return_logprob:
            for k, v in self.logprobs.items():
                meta[k] = v[self._sent[k]:]
                self._sent[k] = len(v)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

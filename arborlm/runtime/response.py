"""`ResponseBuilder`: one sequence's native-API response JSON, in both engine modes.

The JSON is `{"text", "output_ids", "meta_info"}`. `result()` is the final object; `chunk()` is
a streaming event whose `text` / `output_ids` are cumulative and whose logprob lists
(`LOGPROB_KEYS`) hold only what is new since the previous chunk; `event()` is what the caller
gets after an update (a chunk when streaming, else nothing until the final object). With
logprobs, both carry `output_token_logprobs_length`: the number of output logprob entries so
far (SGLang's field; a streaming client adds a chunk's entries to the ones it has).

The two engine modes differ only in where the text comes from, and each has its own input:

- `add(ReqOutput)`, in-process: a scheduler report (token ids, `(logprob, id)` pairs). The
  builder runs the request's text stage itself (`RequestText`, deferred to the end for a request
  that is not streamed, so the scheduler's thread detokenizes it in one call) and decodes the
  logprob entries' token texts; it needs the tokenizer.
- `add_text(BatchTextOutput, i)`, multi-process: entry `i` of a detokenizer process message,
  whose text and logprob texts that process already made (with the same `RequestText`); built
  with `tokenizer=None`.

`fail` ends a sequence with an abort reason and keeps what it has; `abort_event` is the bare
event for a sequence that never ran (a duplicate request id). This module does not route events
to callers or talk to the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from arborlm.runtime.generate_request import SingleRequest
from arborlm.runtime.request_text import RequestText, decode_options

if TYPE_CHECKING:
    from arborlm.runtime.messages import BatchTextOutput, LogprobChunk
    from arborlm.runtime.scheduler.outputs import ReqOutput

# The logprob lists of `meta_info`, in the order they appear there (also `LogprobChunk`'s
# fields), and those of them holding one row of entries per position (None where none).
LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")
NESTED_LOGPROB_KEYS = frozenset({"input_top_logprobs", "output_top_logprobs",
                                 "input_token_ids_logprobs", "output_token_ids_logprobs"})


def abort_reason(message: str, status_code: int) -> dict[str, Any]:
    """An `abort` finish reason as the native API reports it."""
    return {"type": "abort", "message": message, "status_code": status_code}


def abort_event(rid: str, message: str, status_code: int = 400) -> dict[str, Any]:
    """The whole answer for a sequence that ends before producing anything of its own."""
    reason = abort_reason(message, status_code)
    return {"text": "", "output_ids": [], "meta_info": {"id": rid, "finish_reason": reason}}


class ResponseBuilder:
    """One sequence's text, ids, counts and logprob entries, and the events made from them."""

    def __init__(self, req: SingleRequest, tokenizer: Any | None, prompt_ids: Sequence[int]):
        self.req = req
        self.tokenizer = tokenizer
        self._text: RequestText | None = None
        if tokenizer is not None:
            opts = decode_options(req.sampling_params, prompt_ids, stream=req.stream,
                                  return_text_in_logprobs=req.return_text_in_logprobs)
            self._text = RequestText(tokenizer, opts, defer=not req.stream)
        self.start = time.monotonic()
        self.output_ids: list[int] = []
        self.text = ""
        self.meta: dict[str, Any] = {"id": req.rid, "finish_reason": None, "prompt_tokens":
                                     len(prompt_ids), "completion_tokens": 0, "cached_tokens": 0}
        self.logprobs: dict[str, list] = {k: [] for k in LOGPROB_KEYS}
        self._sent = {k: 0 for k in LOGPROB_KEYS}
        self.finished = False

    # --- input --------------------------------------------------------------------------------

    def add(self, out: ReqOutput) -> None:
        """A scheduler report (in-process): detokenized here."""
        if self._text is None:
            raise TypeError("ResponseBuilder.add needs the tokenizer; use add_text for text "
                            "that was detokenized elsewhere")
        self.output_ids.extend(out.new_token_ids)
        self._text.add(out.new_token_ids, out.finished_reason, len(self.output_ids))
        self.text = self._text.text
        self._count(out.prompt_tokens, out.completion_tokens, out.cached_tokens,
                    out.jump_forward_steps, (out.spec_verify_ct, out.spec_accepted_tokens))
        if self.req.return_logprob:
            self._add_logprobs({
                "output_token_logprobs": self._entries(out.output_token_logprobs),
                "output_top_logprobs": self._rows(out.output_top_logprobs),
                "output_token_ids_logprobs": self._rows(out.output_token_ids_logprobs),
                "input_token_logprobs": self._entries(out.input_token_logprobs or []),
                "input_top_logprobs": self._rows(out.input_top_logprobs or []),
                "input_token_ids_logprobs": self._rows(out.input_token_ids_logprobs or [])})
        if out.finished_reason is not None:
            self._end(out.finished_reason)

    def add_text(self, out: BatchTextOutput, i: int) -> None:
        """Entry `i` of a detokenizer process message (multi-process): text already made."""
        self.output_ids.extend(out.output_ids[i])
        self.text = out.texts[i]
        self._count(out.prompt_tokens[i], out.completion_tokens[i], out.cached_tokens[i],
                    out.jump_forward_steps[i] if out.jump_forward_steps else 0,
                    tuple(out.spec[i]) if out.spec else (0, 0))
        lp = out.logprobs[i]
        if self.req.return_logprob and lp is not None:
            self._add_logprobs(_as_lists(lp))
        if out.finished_reasons[i] is not None:
            self._end(out.finished_reasons[i])

    def fail(self, message: str, status_code: int) -> dict[str, Any] | None:
        """End the sequence with an abort, keeping what it has; return its event."""
        self._end(abort_reason(message, status_code))
        return self.event()

    def _count(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               jump_forward_steps: int, spec: tuple[int, int]) -> None:
        """`spec`: (verifies of the request's speculative drafts, draft tokens accepted);
        `spec_accept_length` is the tokens appended per verify, the bonus token included."""
        self.meta.update(completion_tokens=completion_tokens, cached_tokens=cached_tokens,
                         prompt_tokens=prompt_tokens)
        if jump_forward_steps:
            self.meta["jump_forward_steps"] = jump_forward_steps
        verify_ct, accepted = spec
        if verify_ct:
            self.meta["spec_verify_ct"] = verify_ct
            self.meta["spec_accept_length"] = (accepted + verify_ct) / verify_ct

    def _add_logprobs(self, new: dict[str, list]) -> None:
        for key, entries in new.items():
            self.logprobs[key].extend(entries)

    def _end(self, reason: dict[str, Any]) -> None:
        self.finished = True
        self.meta["finish_reason"] = reason
        self.meta["e2e_latency"] = round(time.monotonic() - self.start, 6)

    def _text_of(self, token_id: int) -> str | None:
        if not self.req.return_text_in_logprobs:
            return None
        return self.tokenizer.decode([token_id])

    def _entries(self, pairs: list) -> list[list]:
        return [[lp, tid, self._text_of(tid)] for lp, tid in pairs]

    def _rows(self, rows: list) -> list:
        return [None if row is None else self._entries(row) for row in rows]

    # --- output -------------------------------------------------------------------------------

    def event(self) -> dict[str, Any] | None:
        """A chunk when streaming, else the final object once finished (None before)."""
        if self.req.stream:
            return self.chunk()
        return self.result() if self.finished else None

    def result(self) -> dict[str, Any]:
        meta = dict(self.meta)
        if self.req.return_logprob:
            meta.update({k: list(v) for k, v in self.logprobs.items()})
            meta["output_token_logprobs_length"] = len(self.logprobs["output_token_logprobs"])
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def chunk(self) -> dict[str, Any]:
        """A streaming event: cumulative text and ids, logprob entries new since the last one."""
        meta = dict(self.meta)
        if self.req.return_logprob:
            for k, v in self.logprobs.items():
                meta[k] = v[self._sent[k]:]
                self._sent[k] = len(v)
            meta["output_token_logprobs_length"] = len(self.logprobs["output_token_logprobs"])
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


def _as_lists(lp: LogprobChunk) -> dict[str, list]:
    """A message's logprob entries (tuples) as the native API's `[logprob, id, text]` lists."""
    new: dict[str, list] = {}
    for key in LOGPROB_KEYS:
        rows = getattr(lp, key)
        if key in NESTED_LOGPROB_KEYS:
            new[key] = [None if r is None else [list(e) for e in r] for r in rows]
        else:
            new[key] = [list(e) for e in rows]
    return new

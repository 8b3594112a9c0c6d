"""`RequestText`: one request's output text as its token ids arrive, in both engine modes.

The text stage between the scheduler's token ids and a response: an `IncrementalDetokenizer`
built from the request's `DecodeOptions` (cumulative text, incomplete UTF-8 held back, stop
strings trimmed) and, with the report that finishes the request, `finish_text` (the last ids,
the flush, and the cut at a `stop_regex` match). The in-process `ResponseBuilder` and the
detokenizer process each keep one per request; `decode_options` makes the options from a
request's sampling parameters, as the scheduler process sends them.

With `defer` (a request that is not streamed, in-process) the ids are only collected until the
request finishes and then detokenized in one call: nobody reads the text before, and the
detokenizer gives the same text however the ids are split. This module does not build
responses or decode logprob entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from arborlm.runtime.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from arborlm.runtime.messages import DecodeOptions
from arborlm.runtime.sampling_params import SamplingParams
from arborlm.runtime.stop_matcher import finish_text


def decode_options(params: SamplingParams, prompt_ids: Sequence[int], *,
                   return_text_in_logprobs: bool, stream: bool) -> DecodeOptions:
    """What the text stage needs to know about a request (its prompt's last few ids only)."""
    return DecodeOptions(
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        stop=list(params.stop), no_stop_trim=params.no_stop_trim,
        return_text_in_logprobs=return_text_in_logprobs,
        prompt_tail_ids=list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]),
        stop_regex=list(params.stop_regex), stream=stream,
        min_new_tokens=params.min_new_tokens)


class RequestText:
    """One request's visible text (`text`), updated by `add` with each report's new ids."""

    def __init__(self, tokenizer: Any, opts: DecodeOptions, *, defer: bool = False):
        self.opts = opts
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_ids=opts.prompt_tail_ids,
            skip_special_tokens=opts.skip_special_tokens,
            spaces_between_special_tokens=opts.spaces_between_special_tokens,
            stop=opts.stop, no_stop_trim=opts.no_stop_trim)
        self.text = ""
        self._deferred: list[int] | None = [] if defer else None  # ids not yet detokenized

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self.detok.matched_stop

    def add(self, ids: list[int], reason: dict[str, Any] | None, completion_tokens: int) -> None:
        """A report's new ids; `reason` (not None) finishes the text."""
        if self._deferred is not None:
            self._deferred.extend(ids)
            if reason is None:
                return
            ids, self._deferred = self._deferred, []
        if reason is None:
            self.detok.add(ids)
            self.text = self.detok.text
            return
        o = self.opts
        self.text = finish_text(
            self.detok, ids, reason, stop=o.stop, stop_regex=o.stop_regex,
            no_stop_trim=o.no_stop_trim, min_new_tokens=o.min_new_tokens,
            completion_tokens=completion_tokens)

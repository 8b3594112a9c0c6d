"""`NativeBackend`: the DSL's primitives over the native generate API (docs/api.md).

Shared by `RuntimeEndpoint` (the payloads go over HTTP) and `EngineBackend` (straight to an
in-process `Engine`); a subclass supplies only `request`, `request_stream` and `tokenize`.

`select` scores every choice in one batched prefill. The prompt and each `prompt + choice` are
tokenized the way the runtime tokenizes them; a choice's tokens are the suffix of
`prompt + choice` after its common prefix with the prompt (so a choice that merges with the
prompt's last token is scored on the merged token: token healing). The prompt is prefilled once
(`max_new_tokens: 0`) so the scoring rows share it in the radix cache; then one request with a
row per choice (`input_ids`, `max_new_tokens: 0`, `return_logprob`, `logprob_start_len` = where
the choice's tokens start) returns exactly the choice tokens' logprobs. When the method wants
unconditional logprobs, the same request carries one more row per choice: the choice's tokens
after only the tokenizer's BOS (or nothing, in which case the first entry is the null logprob
the methods handle). Prefill-only warm-ups (this one, `fork`'s, `run_batch`'s) are skipped when
the runtime runs without a prefix cache.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from arborlm.lang.backends.base import BaseBackend
from arborlm.lang.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from arborlm.lang.errors import BackendError
from arborlm.lang.ir import GenParams

if TYPE_CHECKING:
    from arborlm.lang.interpreter import StreamExecutor


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_finished(out: dict[str, Any]) -> dict[str, Any]:
    """`out` itself, unless the runtime aborted the request (then a `BackendError`)."""
    if "error" in out:
        err = out["error"]
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        raise BackendError(f"generation failed: {message}")
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise BackendError(f"request aborted: {reason.get('message')}",
                           reason.get("status_code"))
    return out


class NativeBackend(BaseBackend):
    #: False when the runtime has no prefix cache: prefill-only warm-ups would only cost time,
    #: so `cache_prefix` and `select` skip them.
    prefix_cache_enabled: bool = True
    #: The served model's path (what `get_model_name` reports).
    model_path: str | None = None

    @abc.abstractmethod
    def request(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """One non-streaming native generate call (`POST /generate` body -> response)."""

    @abc.abstractmethod
    def request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """One streaming native generate call: its events (cumulative `text`)."""

    @abc.abstractmethod
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text as the runtime tokenizes a prompt (BOS included)."""

    def get_model_name(self) -> str:
        if self.model_path is None:
            return super().get_model_name()
        return self.model_path

    # --- gen ----------------------------------------------------------------------------------

    def gen_payload(self, text: str, params: GenParams) -> dict[str, Any]:
        return {"text": text, "sampling_params": params.sampling_params(),
                **params.logprob_options()}

    def generate(self, s: StreamExecutor, params: GenParams) -> tuple[str, dict[str, Any]]:
        out = check_finished(self.request(self.gen_payload(s.text_, params)))
        return out["text"], out["meta_info"]

    def generate_stream(self, s: StreamExecutor,
                        params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        payload = {**self.gen_payload(s.text_, params), "stream": True}
        sent = 0
        for chunk in self.request_stream(payload):
            check_finished(chunk)
            text = chunk.get("text", "")
            # The chunk's meta_info as the runtime sent it (its output logprob lists hold only
            # the new entries); the executor adds the chunks up (`stream_meta.accumulate`).
            yield text[sent:], dict(chunk.get("meta_info") or {})
            sent = len(text)

    # --- prefix cache ---------------------------------------------------------------------------

    def cache_prefix(self, prefix: str) -> None:
        if prefix and self.prefix_cache_enabled:
            check_finished(self.request({"text": prefix,
                                         "sampling_params": {"max_new_tokens": 0}}))

    # --- select ---------------------------------------------------------------------------------

    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        ids = self.tokenize([s.text_] + [s.text_ + c for c in choices])
        prompt_ids, rows = ids[0], ids[1:]
        starts = [common_prefix_len(prompt_ids, row) for row in rows]
        for choice, row, start in zip(choices, rows, starts):
            if start >= len(row):
                raise ValueError(f"select choice {choice!r} adds no tokens to the prompt")
        if len(prompt_ids) > 1 and self.prefix_cache_enabled:
            check_finished(self.request({"input_ids": prompt_ids,
                                         "sampling_params": {"max_new_tokens": 0}}))
        rows, starts = list(rows), list(starts)
        if choices_method.requires_unconditional_logprobs:
            context = self.tokenize([""])[0]
            choice_tokens = [row[st:] for row, st in zip(rows, starts)]
            rows += [context + toks for toks in choice_tokens]
            starts += [len(context)] * len(choices)
        outs = self.request({"input_ids": rows, "sampling_params": {"max_new_tokens": 0},
                             "return_logprob": True, "logprob_start_len": starts,
                             "return_text_in_logprobs": True})
        logprobs = [check_finished(o)["meta_info"]["input_token_logprobs"] for o in outs]
        n = len(choices)
        conditional = logprobs[:n]
        return choices_method(
            choices=list(choices),
            normalized_prompt_logprobs=[mean_logprob(e) for e in conditional],
            input_token_logprobs=conditional,
            output_token_logprobs=[o["meta_info"].get("output_token_logprobs", [])
                                   for o in outs[:n]],
            unconditional_token_logprobs=logprobs[n:] or None,
        )

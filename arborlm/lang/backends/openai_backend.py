"""`OpenAI`: programs run against any OpenAI-compatible server (`/v1` routes).

Chat models (the default) get `gen` as a chat completion of the program's messages so far, so
a `gen` must sit inside `assistant(...)`; the program's text uses the registry's template only
for display. Completion models (`is_chat_model=False`) get the program's text as a completion
prompt and also support `select`: one `/v1/completions` request with `echo`, `logprobs` and
`max_tokens: 0` returns the prompt logprobs of the prompt alone and of `prompt + choice` for
each choice (plus each choice alone, for unconditional scoring); a choice's tokens are those
after the common prefix with the prompt's tokens. The chat API returns no prompt logprobs, so
`select` on a chat model is an error that says so.

Sampling options outside OpenAI's own (`top_k`, `min_p`, `regex`, `ignore_eos`, ...) go in
`extra_body`, as ArborLM's and vLLM's servers accept them, and only when set to a non-default
value. Uses the `openai` package (imported on first use).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from arborlm.lang.backends.base import BaseBackend
from arborlm.lang.chat_template import ChatTemplate, get_chat_template_by_model_path
from arborlm.lang.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from arborlm.lang.errors import BackendError
from arborlm.lang.ir import GenParams

if TYPE_CHECKING:
    from arborlm.lang.interpreter import StreamExecutor

# Extension fields and the value that means "not set" (not sent then).
_EXTRA_DEFAULTS = {"top_k": -1, "min_p": 0.0, "ignore_eos": False, "stop_token_ids": None,
                   "min_new_tokens": None, "regex": None}
_EXTRA_NAMES = {"min_new_tokens": "min_tokens"}


class OpenAI(BaseBackend):
    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool = True, chat_template: ChatTemplate | None = None,
                 **client_kwargs: Any):
        try:
            import openai
        except ImportError as e:
            raise BackendError("the OpenAI backend needs the `openai` package "
                               "(pip install openai)") from e
        self.model_name = model_name
        self.is_chat_model = is_chat_model
        self.chat_template = chat_template or get_chat_template_by_model_path(model_name)
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = openai.OpenAI(base_url=base_url, api_key=key, **client_kwargs)
        self._errors = (openai.OpenAIError,)

    # --- requests -------------------------------------------------------------------------------

    def get_model_name(self) -> str:
        return self.model_name

    def _request_args(self, s: StreamExecutor, params: GenParams) -> dict[str, Any]:
        args: dict[str, Any] = {"model": self.model_name, "max_tokens": params.max_new_tokens}
        for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
            if getattr(params, name) is not None:
                args[name] = getattr(params, name)
        if params.stop:
            args["stop"] = params.stop_list()
        extra = {_EXTRA_NAMES.get(k, k): getattr(params, k) for k, default in
                 _EXTRA_DEFAULTS.items() if getattr(params, k) not in (None, default)}
        regex = params.constraint_regex()
        if regex is not None:
            extra["regex"] = regex
        if self.is_chat_model:
            if s.cur_role != "assistant":
                raise ValueError("with a chat model, gen must be inside assistant(...)")
            args["messages"] = s.messages_
            if params.json_schema is not None:
                args["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": json.loads(params.json_schema)}}
            if params.return_logprob:
                args.update(logprobs=True, top_logprobs=params.top_logprobs_num or 0)
        else:
            args["prompt"] = s.text_
            if params.json_schema is not None:
                extra["json_schema"] = params.json_schema
            if params.return_logprob:
                args["logprobs"] = params.top_logprobs_num or 0
        if extra:
            args["extra_body"] = extra
        return args

    def _create(self, **args: Any) -> Any:
        api = self.client.chat.completions if "messages" in args else self.client.completions
        try:
            return api.create(**args)
        except self._errors as e:
            raise BackendError(f"OpenAI-compatible request failed: {e}",
                               getattr(e, "status_code", None)) from e

    def generate(self, s: StreamExecutor, params: GenParams) -> tuple[str, dict[str, Any]]:
        resp = self._create(**self._request_args(s, params))
        choice = resp.choices[0]
        text = choice.message.content if self.is_chat_model else choice.text
        meta = _meta(resp.id, choice.finish_reason, resp.usage)
        if choice.logprobs is not None:
            meta["logprobs"] = choice.logprobs.model_dump()
        return text or "", meta

    def generate_stream(self, s: StreamExecutor,
                        params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        args = {**self._request_args(s, params), "stream": True,
                "stream_options": {"include_usage": True}}
        meta: dict[str, Any] = {}
        for chunk in self._create(**args):
            delta, reason = "", None
            if chunk.choices:
                c = chunk.choices[0]
                delta = (c.delta.content if self.is_chat_model else c.text) or ""
                reason = c.finish_reason
            if reason is not None or chunk.usage is not None:
                meta = _meta(chunk.id, reason or meta.get("finish_reason", {}).get("type"),
                             chunk.usage)
            yield delta, dict(meta)

    # --- select ---------------------------------------------------------------------------------

    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        if self.is_chat_model:
            raise BackendError("select needs prompt logprobs, which the chat completions API "
                               "does not return; use OpenAI(..., is_chat_model=False) or "
                               "RuntimeEndpoint")
        unconditional = choices_method.requires_unconditional_logprobs
        prompts = [s.text_] + [s.text_ + c for c in choices]
        prompts += list(choices) if unconditional else []
        resp = self._create(model=self.model_name, prompt=prompts, max_tokens=0, echo=True,
                            logprobs=0, temperature=0)
        rows = [_echo_entries(c.logprobs) for c in sorted(resp.choices, key=lambda c: c.index)]
        prompt_tokens = [e[2] for e in rows[0]]
        n = len(choices)
        conditional = []
        for entries in rows[1:n + 1]:
            start = 0
            while (start < len(prompt_tokens) and start < len(entries) - 1
                   and entries[start][2] == prompt_tokens[start]):
                start += 1
            conditional.append(entries[start:])
        # A choice alone is echoed with the server's BOS first: keep its own tokens only.
        alone = [row[len(row) - len(c):] for row, c in zip(rows[n + 1:], conditional)]
        return choices_method(
            choices=list(choices),
            normalized_prompt_logprobs=[mean_logprob(e) for e in conditional],
            input_token_logprobs=conditional, output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=alone if unconditional else None)


def _echo_entries(logprobs: Any) -> list[list]:
    """A completion's echoed logprobs as native entries `[logprob, None, token text]`."""
    if logprobs is None:
        raise BackendError("the server returned no logprobs for an echo request")
    return [[lp, None, tok] for lp, tok in zip(logprobs.token_logprobs, logprobs.tokens)]


def _meta(rid: str, finish_reason: str | None, usage: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "finish_reason": None if finish_reason is None
                            else {"type": finish_reason}}
    if usage is not None:
        details = getattr(usage, "prompt_tokens_details", None)
        meta.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    cached_tokens=getattr(details, "cached_tokens", 0) or 0)
    return meta

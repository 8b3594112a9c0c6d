"""Pydantic models of the OpenAI-compatible requests (`/v1/completions`, `/v1/chat/completions`).

Field names, defaults and bounds follow OpenAI's API; ArborLM's extensions (docs/api.md: `top_k`,
`min_p`, `regex`, `rid`, ...) sit beside them and arrive from the `openai` client as
`extra_body`. `base_sampling()` maps a request onto the engine's native sampling parameters;
the engine checks the remaining value ranges. Fields OpenAI defines but ArborLM ignores
(`user`, `store`, ...) are accepted; unknown fields are a 400 naming them, as OpenAI does.
`response_format` maps onto the engine's `json_schema` grammar here (`sampling()`); tools and
`tool_choice` are typed here and turned into a grammar and a parser by `tool_calls.py`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from arborlm.server.limits import MAX_N, MAX_OPENAI_TOP_LOGPROBS
from arborlm.server.protocol import Bool, Float, Int, JsonObject, Str, TokenIds, valid_tree

ANY_OBJECT = {"type": "object"}  # `json_object`, and `json_schema` without a schema


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Model):
    include_usage: Bool = False


class _SamplingFields(_Model):
    """Fields shared by completions and chat completions (OpenAI's, then ArborLM's)."""

    model: Str | None = None
    temperature: Float | None = Field(default=None, ge=0)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    n: Int = Field(default=1, ge=1, le=MAX_N)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Str | list[Str] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[Str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # OpenAI fields accepted and ignored.
    user: Str | None = None
    store: Bool | None = None
    metadata: dict[Str, Str] | None = None
    service_tier: Str | None = None
    # ArborLM / SGLang extensions (docs/api.md).
    top_k: Int | None = None
    min_p: Float | None = None
    min_tokens: Int | None = Field(default=None, ge=0)
    repetition_penalty: Float | None = None
    regex: Str | None = None
    ebnf: Str | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: Bool | None = None
    skip_special_tokens: Bool | None = None
    spaces_between_special_tokens: Bool | None = None
    no_stop_trim: Bool | None = None
    rid: Str | None = None
    priority: Int | None = None

    def base_sampling(self) -> dict[str, Any]:
        params = {
            "temperature": self.temperature, "top_p": self.top_p, "n": self.n,
            "stop": self.stop, "sampling_seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "logit_bias": self.logit_bias,
            "top_k": self.top_k, "min_p": self.min_p, "min_new_tokens": self.min_tokens,
            "repetition_penalty": self.repetition_penalty, "regex": self.regex,
            "ebnf": self.ebnf, "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim,
        }
        return {k: v for k, v in params.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """Body of `POST /v1/completions`."""

    prompt: Str | list[Str] | TokenIds | list[TokenIds]
    max_tokens: Int | None = Field(default=16, ge=0)
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_OPENAI_TOP_LOGPROBS)
    echo: Bool = False
    best_of: Int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: Str | None = None
    json_schema: Str | None = None
    json_schema_strict: Bool | None = None


# --- chat ------------------------------------------------------------------------------------


class ContentPart(BaseModel):
    """One part of a message's content; only `text` parts can reach a text-only model."""

    model_config = ConfigDict(extra="allow")

    type: Str
    text: Str | None = None

    @model_validator(mode="after")
    def _valid_extras(self) -> ContentPart:
        valid_tree(self.model_extra or {})
        return self


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Str
    arguments: Str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: Str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[ContentPart] | None = None
    name: Str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Str | None = None


class FunctionDef(_Model):
    name: Str
    description: Str | None = None
    parameters: JsonObject | None = None
    strict: Bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Model):
    name: Str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaSpec(_Model):
    name: Str | None = None
    description: Str | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormatText(_Model):
    type: Literal["text"]

    def sampling(self) -> dict[str, Any]:
        return {}


class ResponseFormatJsonObject(_Model):
    type: Literal["json_object"]

    def sampling(self) -> dict[str, Any]:
        return {"json_schema": json.dumps(ANY_OBJECT)}


class ResponseFormatJsonSchema(_Model):
    """`strict` (default true) is the engine's `json_schema_strict`: strict refuses a schema
    whose every keyword cannot be guaranteed (a 400 naming the JSON pointer); false accepts it
    and reports what is not enforced and whether the output validated (`json_schema_unenforced`,
    `json_schema_valid` on the choice). Objects are closed unless they allow
    `additionalProperties` (see `arborlm.constrained.xgrammar_backend`)."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec

    def sampling(self) -> dict[str, Any]:
        schema = self.json_schema.schema_
        strict = self.json_schema.strict is not False
        return {"json_schema": json.dumps(ANY_OBJECT if schema is None else schema),
                "json_schema_strict": strict}


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type")]


class ChatCompletionRequest(_SamplingFields):
    """Body of `POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = Field(default=None, ge=0)
    max_completion_tokens: Int | None = Field(default=None, ge=0)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_OPENAI_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    chat_template_kwargs: JsonObject | None = None

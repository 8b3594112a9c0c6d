"""Pydantic models of the native API's requests (SGLang's field names, see docs/api.md).

These models check types and shapes at the edge, and that every string is valid Unicode (`Str`,
`JsonObject`); value ranges, finiteness and sizes that the engine also needs (sampling ranges,
seeds, `n`, stop strings and regexes, logprob options) are checked once, by the engine's
`SamplingParams` / `GenerateRequest` (`arborlm.runtime.request_limits`), whose errors name the
field and its allowed range.
`to_generate_request()` builds the engine's one internal request shape. Fields that SGLang
clients send but ArborLM does not implement (LoRA, images, ...) are accepted only at their
"off" value, so scripts written for SGLang work unchanged and a real use of them is a clear 400.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Strict, model_validator

from arborlm.errors import InvalidRequestError
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.runtime.request_limits import tree_error, unicode_error


def _valid_unicode(value: str) -> str:
    why = unicode_error(value)
    if why is not None:
        raise ValueError(why)
    return value


def valid_tree(value: Any) -> Any:
    found = tree_error(value)
    if found is not None:
        path, why = found
        raise ValueError(f"{path} {why}" if path else why)
    return value


Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict float still accepts JSON integers
Bool = Annotated[bool, Strict()]
# Every string of every request is valid Unicode: JSON can carry a lone surrogate (`"\ud800"`),
# which no tokenizer, encoder or socket accepts.
Str = Annotated[str, Strict(), AfterValidator(_valid_unicode)]
# Free-form JSON objects (tool parameters, schemas, template arguments): valid Unicode in every
# key and string, finite numbers.
JsonObject = Annotated[dict[str, Any], AfterValidator(valid_tree)]
TokenIds = list[Int]

# SGLang request fields ArborLM does not implement; accepted when null / false / empty.
UNSUPPORTED_SGLANG_FIELDS = (
    "lora_path", "lora_id", "image_data", "video_data", "audio_data", "input_embeds",
    "session_params", "custom_logit_processor", "return_hidden_states", "return_routed_experts",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank", "modalities",
    "log_metrics", "background", "no_logs", "return_bytes",
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsInput(_Model):
    """`sampling_params` of /generate. Null values mean "the default"."""

    max_new_tokens: Int | None = None
    min_new_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    repetition_penalty: Float | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: TokenIds | None = None
    stop_regex: Str | list[Str] | None = None
    no_stop_trim: Bool | None = None
    ignore_eos: Bool | None = None
    skip_special_tokens: Bool | None = None
    spaces_between_special_tokens: Bool | None = None
    n: Int | None = None
    logit_bias: dict[Str, Float] | None = None
    sampling_seed: Int | None = None
    json_schema: Str | None = None
    json_schema_strict: Bool | None = None  # ArborLM's: true (default) refuses, false reports
    regex: Str | None = None
    ebnf: Str | None = None
    structural_tag: Str | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class GenerateReqInput(_Model):
    """Body of `POST /generate`: one prompt, or a batch when `text` / `input_ids` is a list."""

    text: Str | list[Str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: SamplingParamsInput | list[SamplingParamsInput] | None = None
    rid: Str | list[Str] | None = None
    return_logprob: Bool | list[Bool] | None = None
    logprob_start_len: Int | list[Int] | None = None
    top_logprobs_num: Int | list[Int] | None = None
    token_ids_logprob: TokenIds | list[TokenIds] | None = None
    return_text_in_logprobs: Bool = False
    stream: Bool = False
    priority: Int | None = None
    extra_key: Str | list[Str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name in UNSUPPORTED_SGLANG_FIELDS:
            value = data.pop(name, None)
            if value not in (None, False, [], {}, ""):
                raise ValueError(f"{name} is not supported by ArborLM (send null or omit it)")
        return data

    def to_generate_request(self) -> GenerateRequest:
        params = self.sampling_params
        if isinstance(params, list):
            sampling: dict | list[dict] | None = [p.to_dict() for p in params]
        else:
            sampling = params.to_dict() if params is not None else None
        return GenerateRequest(
            text=self.text, input_ids=self.input_ids, sampling_params=sampling, rid=self.rid,
            return_logprob=_or(self.return_logprob, False),
            logprob_start_len=_or(self.logprob_start_len, -1),
            top_logprobs_num=_or(self.top_logprobs_num, 0),
            token_ids_logprob=self.token_ids_logprob,
            return_text_in_logprobs=self.return_text_in_logprobs, stream=self.stream,
            priority=self.priority, extra_key=self.extra_key)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class AbortReqInput(_Model):
    """Body of `POST /abort_request`: one request id, or every request."""

    rid: Str | None = None
    abort_all: Bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortReqInput:
        if self.rid is None and not self.abort_all:
            raise InvalidRequestError("give rid or abort_all: true", "rid")
        return self


class FlushCacheInput(BaseModel):
    """Optional body of `POST /flush_cache` (SGLang's frontend sends `empty_cache`)."""

    model_config = ConfigDict(extra="ignore")

    empty_cache: Bool = True


class TokenizeInput(_Model):
    """Body of `POST /tokenize`."""

    model: Str | None = None
    prompt: Str | list[Str]
    add_special_tokens: Bool = True


class DetokenizeInput(_Model):
    """Body of `POST /detokenize`."""

    model: Str | None = None
    tokens: TokenIds | list[TokenIds]
    skip_special_tokens: Bool = False

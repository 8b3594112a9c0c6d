"""Every message that crosses a process boundary, as tagged `msgspec` structs, and their codec.

Routes (addresses come from `arborlm.runtime.ipc.IpcAddresses`):

```
TokenizerManager --TokenizedGenerateReq, BatchTokenizedGenerateReq, AbortReq, FlushCacheReq,
                   GetServerInfoReq, HealthCheckReq, ShutdownReq--> Scheduler (rank 0)
Scheduler --BatchTokenOutput, ErrorOutput, FlushCacheResp, ServerInfoResp,
            HealthCheckResp, ShutdownReq--> Detokenizer
Detokenizer --BatchTextOutput, ErrorOutput, FlushCacheResp, ServerInfoResp,
              HealthCheckResp, ShutdownReq--> TokenizerManager   (forwarded unchanged)
Child process --ProcessProgress, ProcessReady, ProcessFailed--> parent
              (over the startup pipe, not ZeroMQ)
```

Batch messages are column-oriented: entry `i` of every list belongs to `rids[i]`.

Per-request decode options reach the detokenizer in-band: a request's first `BatchTokenOutput`
entry carries its `DecodeOptions` (`decode_options[i]` is None in later chunks). There is no
separate init message, so nothing can arrive out of order or be left behind by an abort: the
detokenizer creates its state on the entry with options and drops it on the entry with a finish
reason.

Logprob entries are `(logprob, token_id, text)` tuples, the native API's `[logprob, id, text]`;
the scheduler leaves `text` None and the detokenizer fills it in when `return_text_in_logprobs`.
A logprob is None only at the first prompt position (nothing predicts it).

This module holds data definitions and the codec only; sockets live in `zmq_queues`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from arborlm.errors import MessageDecodeError

# (logprob, token id, token text); logprob None at the first prompt position.
LogprobEntry = tuple[float | None, int, str | None]


class _Message(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Base of the process-boundary messages: the tag is the class name."""


class _Part(msgspec.Struct, array_like=True, omit_defaults=True):
    """Base of structs nested inside messages (never sent on their own)."""


class LogprobChunk(_Part):
    """One request's logprobs added by one step; `input_*` only in a request's first chunk."""

    output_token_logprobs: list[LogprobEntry] = []
    output_top_logprobs: list[list[LogprobEntry]] = []
    output_token_ids_logprobs: list[list[LogprobEntry]] = []
    input_token_logprobs: list[LogprobEntry] = []
    input_top_logprobs: list[list[LogprobEntry] | None] = []
    input_token_ids_logprobs: list[list[LogprobEntry] | None] = []


class DecodeOptions(_Part):
    """What the detokenizer needs to know about a request, sent with its first output."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = []
    no_stop_trim: bool = False
    return_text_in_logprobs: bool = False
    # The last few prompt ids: decoding context for the first output token's leading space.
    prompt_tail_ids: list[int] = []
    stop_regex: list[str] = []  # a `stop_regex` match cuts the final text at its start
    stream: bool = False  # False: the detokenizer sends the request's text only when it ends
    min_new_tokens: int = 0  # stop_regex is scanned from then on (`stop_matcher.finish_text`)


# --- tokenizer manager -> scheduler ------------------------------------------------------------


class TokenizedGenerateReq(_Message):
    """A validated, tokenized generation request."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # `SamplingParams` fields, as `dataclasses.asdict` gives
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    extra_key: str | None = None
    priority: int = 0
    seed: int | None = None


class BatchTokenizedGenerateReq(_Message):
    """The sequences of one generate call (prompts × n), to be queued in one go as the
    in-process engine does, so that they can share a prefill step."""

    reqs: list[TokenizedGenerateReq]


class AbortReq(_Message):
    """Abort one request (`rid`) or every request (`abort_all`)."""

    rid: str | None = None
    abort_all: bool = False


class FlushCacheReq(_Message):
    """Empty the prefix cache (refused while requests are pending)."""


class GetServerInfoReq(_Message):
    """Ask the scheduler for live figures (queue sizes, token capacity, cache hit rate)."""


class HealthCheckReq(_Message):
    """Ask whether the scheduler loop is alive and serving."""


class ShutdownReq(_Message):
    """Stop the receiving process after its current step; no reply."""


# --- replies to control requests ---------------------------------------------------------------


class FlushCacheResp(_Message):
    ok: bool
    message: str = ""
    dp_rank: int = 0  # the replica that answers (set by its detokenizer)


class ServerInfoResp(_Message):
    info: dict[str, Any]
    dp_rank: int = 0  # the replica that answers (set by its detokenizer)


class HealthCheckResp(_Message):
    ok: bool
    message: str = ""
    dp_rank: int = 0  # the replica that answers (set by its detokenizer)


# --- outputs -----------------------------------------------------------------------------------


class BatchTokenOutput(_Message):
    """Scheduler -> detokenizer: the new token ids of one step, per request."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]  # `FinishReason.to_json()` once finished
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    decode_options: list[DecodeOptions | None]  # set in each request's first chunk only
    logprobs: list[LogprobChunk | None]  # None where the request did not ask for logprobs
    jump_forward_steps: list[int] = []  # per request; empty when every entry would be 0
    # Per request (verifies of its drafts, draft tokens accepted); empty when no request drafts.
    spec: list[tuple[int, int]] = []


class BatchTextOutput(_Message):
    """Detokenizer -> tokenizer manager: cumulative text and the new ids, per request."""

    rids: list[str]
    texts: list[str]  # cumulative visible text (stop strings trimmed, incomplete chars held)
    output_ids: list[list[int]]  # only the ids new in this message
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[LogprobChunk | None]  # entries carry texts when return_text_in_logprobs
    matched_stops: list[str | None]  # the stop string that ended the text, if any
    jump_forward_steps: list[int] = []  # per request; empty when every entry would be 0
    spec: list[tuple[int, int]] = []  # as in `BatchTokenOutput`


class ErrorOutput(_Message):
    """A request failed on its own (bad grammar, too long, sampling error); others go on.
    `param` names the offending field of an invalid request, where there is one."""

    rid: str
    message: str
    status_code: int = 400
    param: str | None = None


# --- child process -> parent, once at startup (and once more if it fails later) ----------------


class ProcessProgress(_Message):
    """A starting child began a startup phase ("compiling kernels", "loading weights", ...)."""

    process: str
    phase: str


class ProcessReady(_Message):
    """A child finished starting (model loaded, sockets bound); `info` holds its figures."""

    process: str
    info: dict[str, Any] = {}


class ProcessFailed(_Message):
    """A child failed to start, or its loop failed; the parent reports this to callers."""

    process: str
    error_type: str  # the exception's class name (an `arborlm.errors` name is raised as such)
    message: str
    traceback: str = ""


Message = (
    TokenizedGenerateReq
    | BatchTokenizedGenerateReq
    | AbortReq
    | FlushCacheReq
    | GetServerInfoReq
    | HealthCheckReq
    | ShutdownReq
    | FlushCacheResp
    | ServerInfoResp
    | HealthCheckResp
    | BatchTokenOutput
    | BatchTextOutput
    | ErrorOutput
    | ProcessProgress
    | ProcessReady
    | ProcessFailed
)
MESSAGE_TYPES: tuple[type[_Message], ...] = Message.__args__

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """msgpack bytes of a message; anything that is not a `Message` member is a TypeError."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"not a process-boundary message: {type(msg).__name__}")
    return _encoder.encode(msg)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message encoded in `data`; `MessageDecodeError` says why when it is not one."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise MessageDecodeError(f"cannot decode a message from {len(data)} bytes: {e}") from e

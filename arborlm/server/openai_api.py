"""The OpenAI-compatible API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each route turns its request (see `openai_protocol.py`) into one native `GenerateRequest`,
runs it through the shared `GenerationRunner`, and shapes the native events into OpenAI's
objects (`openai_format.py`): choices in prompt-major order (prompt i, sample j -> index
i * n + j), `usage` with cached prompt tokens, and for `stream` OpenAI's chunk format ending in
`data: [DONE]`, with a final usage chunk when `stream_options.include_usage` is set. Chat
prompts are rendered with the chat template (`chat.py`) and sent to the engine as token ids.

Structured outputs: one grammar per request — `response_format` (`json_object` / `json_schema`),
the `regex` / `ebnf` extensions, or tool calls forced by `tool_choice` (`required`, a named
function; see `tool_calls.py`). A grammar the engine rejects is a 400 naming the request field
it came from. A `json_schema` with `strict: false` is accepted where it cannot be guaranteed;
each choice (in a stream, its last chunk) then carries `json_schema_unenforced` and
`json_schema_valid` (`schema_report.py`). Streaming with tools sends text as it comes until a
`<tool_call>` starts, then holds the rest and sends the calls, each whole in one `tool_calls`
delta, when the choice ends (arguments are not streamed piece by piece).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from arborlm.constrained.base import ANY_WHITESPACE_MAX_RUN
from arborlm.errors import InvalidRequestError
from arborlm.runtime import schema_report
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.server import openai_format as fmt
from arborlm.server import sse
from arborlm.server.errors import ApiError, error_body
from arborlm.server.generation import Event, collect_finals, race_disconnect, started
from arborlm.server.jsonresp import JSONResponse
from arborlm.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from arborlm.server.state import ServerState, server_state
from arborlm.server.tool_calls import ToolCallStream, ToolPolicy, tool_policy

logger = logging.getLogger(__name__)
router = APIRouter()
START_TIME = int(time.time())
# Whitespace allowed per gap of the JSON arguments of forced tool calls: one character (so both
# compact JSON and ", " / ": " separators fit), or the engine's bound with --grammar-any-whitespace.
TOOL_ARGS_WHITESPACE = 1
# The request field each engine grammar kind comes from, per route.
COMPLETION_GRAMMAR_FIELDS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}
CHAT_GRAMMAR_FIELDS = {"json_schema": "response_format", "regex": "regex", "ebnf": "ebnf",
                       "structural_tag": "tools"}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = server_state(request)
    card = {"id": state.model_name, "object": "model", "created": START_TIME,
            "owned_by": "arborlm", "root": state.client.config.model.path,
            "max_model_len": state.context_length}
    return JSONResponse({"object": "list", "data": [card]})


@dataclass
class _Reply:
    """What shaping a response needs besides the events."""

    id: str
    object: str
    model: str
    n: int
    logprobs: bool
    include_usage: bool
    path: str
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}


# --- completions -------------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    if body.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, f"best_of must equal n ({body.n}); ArborLM returns every sample",
                       "best_of")
    texts, ids = _prompts(body.prompt)
    count = len(texts if texts is not None else ids)
    base = body.rid or f"cmpl-{uuid.uuid4().hex}"
    sampling = body.base_sampling()
    sampling["max_new_tokens"] = (body.max_tokens if body.max_tokens is not None
                                  else state.context_length)
    if body.json_schema is not None:
        sampling["json_schema"] = body.json_schema
    if body.json_schema_strict is not None:
        sampling["json_schema_strict"] = body.json_schema_strict
    wants_lp = body.logprobs is not None
    req = GenerateRequest(
        text=texts, input_ids=ids, sampling_params=sampling,
        rid=base if count == 1 else [f"{base}-p{i}" for i in range(count)],
        return_logprob=wants_lp, top_logprobs_num=body.logprobs or 0,
        logprob_start_len=0 if body.echo and wants_lp else -1, priority=body.priority)
    echoes = None
    if body.echo:
        echoes = texts if texts is not None else [_decode_echo(state, p) for p in ids]
    reply = _Reply(base, "text_completion", state.model_name, body.n, wants_lp,
                   body.include_usage, request.url.path)
    events = _events(state, req)
    with _grammar_error_field(sampling, COMPLETION_GRAMMAR_FIELDS):
        if body.stream:
            stream = await started(request, events)
            return sse.SSEResponse(_completion_stream(state, reply, stream, echoes))
        finals = await race_disconnect(request, collect_finals(events))
    choices = [{**fmt.completion_choice(i, f, state.token_texts, logprobs=wants_lp,
                                        echo=None if echoes is None else echoes[i // body.n]),
                **schema_report.choice_fields(f["meta_info"])}
               for i, f in enumerate(finals)]
    return JSONResponse(reply.envelope(choices, usage=fmt.usage(finals, body.n)))


def _decode_echo(state: Any, ids: list[int]) -> str:
    """The text of a token-id prompt to echo; ids outside the vocabulary are the caller's error
    (checked here because decoding comes before the engine validates the prompt)."""
    vocab = state.client.config.model.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}), got {bad}", "prompt")
    return state.tokenizer.decode(ids)


def _prompts(prompt: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    if isinstance(prompt, str):
        return [prompt], None
    if prompt and isinstance(prompt[0], int):
        return None, [prompt]
    if prompt and isinstance(prompt[0], list):
        return None, prompt
    if not prompt:
        raise InvalidRequestError("prompt is empty", "prompt")
    return prompt, None


async def _completion_stream(state: ServerState, reply: _Reply, stream: AsyncIterator[Event],
                             echoes: list[str] | None) -> AsyncIterator[bytes]:
    texts = state.token_texts

    def chunk(index: int, event: dict[str, Any], sent: int, first: bool) -> dict[str, Any]:
        meta = event["meta_info"]
        delta = event["text"][sent:]
        echo = None if echoes is None else echoes[index // reply.n]
        lp = None
        if reply.logprobs:
            lp = fmt.completion_logprobs(texts, fmt.completion_segments(meta, echo, sent))
        if first and echo is not None:
            delta = echo + delta
        return {"index": index, "text": delta, "logprobs": lp,
                "finish_reason": fmt.finish_reason(meta), "matched_stop": fmt.matched_stop(meta),
                **schema_report.choice_fields(meta)}

    async for item in _openai_stream(reply, stream, chunk):
        yield item


# --- chat --------------------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    tools = tool_policy(body.tools, body.tool_choice, body.parallel_tool_calls)
    sampling = body.base_sampling()
    sampling.update(_chat_grammar(body, tools, state))
    prompt = state.chat.render(body.messages, tools.offered, body.chat_template_kwargs)
    ids = state.chat.encode(prompt)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    sampling["max_new_tokens"] = limit if limit is not None else state.context_length
    base = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
    top = body.top_logprobs or 0
    req = GenerateRequest(input_ids=ids, sampling_params=sampling, rid=base,
                          return_logprob=body.logprobs, top_logprobs_num=top if body.logprobs
                          else 0, priority=body.priority)
    reply = _Reply(base, "chat.completion", state.model_name, body.n, body.logprobs,
                   body.include_usage, request.url.path)
    events = _events(state, req)
    with _grammar_error_field(sampling, CHAT_GRAMMAR_FIELDS):
        if body.stream:
            stream = await started(request, events)
            reply.object = "chat.completion.chunk"
            return sse.SSEResponse(_chat_stream(state, reply, stream, tools.names))
        finals = await race_disconnect(request, collect_finals(events))
    choices = [{**fmt.chat_choice(i, f, state.token_texts, logprobs=body.logprobs,
                                  tool_names=tools.names),
                **schema_report.choice_fields(f["meta_info"])}
               for i, f in enumerate(finals)]
    return JSONResponse(reply.envelope(choices, usage=fmt.usage(finals, body.n)))


def _chat_grammar(body: ChatCompletionRequest, tools: ToolPolicy,
                  state: ServerState) -> dict[str, Any]:
    """Sampling fields of the one grammar that may constrain a chat completion: forced tool
    calls or `response_format` (`regex` / `ebnf` are already in the base sampling fields)."""
    response_format = body.response_format
    asked = [name for name, on in (
        ("response_format", response_format is not None and response_format.type != "text"),
        ("regex", body.regex is not None), ("ebnf", body.ebnf is not None),
        ("tool_choice", bool(tools.forced))) if on]
    if len(asked) > 1:
        raise InvalidRequestError(
            "at most one of response_format (json_object / json_schema), regex, ebnf and "
            f"tool_choice 'required' / a named function may be given; got {' and '.join(asked)}",
            asked[-1])
    if tools.forced:
        whitespace = (ANY_WHITESPACE_MAX_RUN if state.engine_args.grammar_any_whitespace
                      else TOOL_ARGS_WHITESPACE)
        return {"structural_tag": tools.grammar(whitespace), "grammar_backend": "xgrammar"}
    return response_format.sampling() if response_format is not None else {}


def _events(state: ServerState, req: GenerateRequest) -> AsyncIterator[Event]:
    """The engine's events of `req`, with the report of each non-strict JSON schema."""
    return schema_report.attach(state.runner.events(req, "max_tokens"), req,
                                state.engine_args.grammar_backend)


@contextmanager
def _grammar_error_field(sampling: dict[str, Any], fields: dict[str, str]) -> Iterator[None]:
    """Re-raise the engine's error about the request's grammar as one about the request field
    it came from (`fields`: grammar kind -> field). The engine names the grammar kind as the
    error's param, or, from a child process, starts its message with it."""
    try:
        yield
    except InvalidRequestError as e:
        kind = next((k for k in fields if k in sampling), None)
        named = e.param is None and kind is not None and e.message.startswith(
            (f"invalid {kind}:", f"{kind} "))
        if kind is None or not (e.param == kind or named):
            raise
        field = fields[kind]
        message = e.message if field == kind else f"{field}: {e.message}"
        raise InvalidRequestError(message, field) from e


async def _chat_stream(state: ServerState, reply: _Reply, stream: AsyncIterator[Event],
                       tool_names: frozenset[str]) -> AsyncIterator[bytes]:
    texts = state.token_texts
    splits: dict[int, ToolCallStream] = {}

    def chunk(index: int, event: dict[str, Any], sent: int, first: bool) -> dict[str, Any]:
        meta = event["meta_info"]
        split = splits.setdefault(index, ToolCallStream(tool_names))
        reason = fmt.finish_reason(meta)
        if reason is None:
            text, calls = split.content(event["text"]), []
        else:
            text, calls = split.finish(event["text"])
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [fmt.tool_call(call, k) for k, call in enumerate(calls)]
        lp = None
        if reply.logprobs:
            lp = fmt.chat_logprobs(texts, meta.get("output_token_logprobs", []),
                                   meta.get("output_top_logprobs", []))
        return {"index": index, "delta": delta, "logprobs": lp,
                "finish_reason": fmt.tool_finish_reason(reason, calls),
                "matched_stop": fmt.matched_stop(meta), **schema_report.choice_fields(meta)}

    async for item in _openai_stream(reply, stream, chunk):
        yield item


# --- streaming, shared -------------------------------------------------------------------------

ChunkFn = Callable[[int, dict[str, Any], int, bool], dict[str, Any]]


async def _openai_stream(reply: _Reply, stream: AsyncIterator[Event],
                         make_choice: ChunkFn) -> AsyncIterator[bytes]:
    """OpenAI chunks from native events: one choice delta per event that adds something."""
    sent: dict[int, int] = {}
    finals: dict[int, dict[str, Any]] = {}
    extra = {"usage": None} if reply.include_usage else {}
    try:
        async with aclosing(stream):
            async for index, event in stream:
                first = index not in sent
                choice = make_choice(index, event, sent.get(index, 0), first)
                sent[index] = max(sent.get(index, 0), len(event["text"]))
                if event["meta_info"].get("finish_reason") is not None:
                    finals[index] = event
                if first or _adds_something(choice):
                    yield sse.event(reply.envelope([choice], **extra))
    except InvalidRequestError as e:
        yield sse.event(error_body(reply.path, 400, e.message, e.param))
    except ApiError as e:
        yield sse.event(error_body(reply.path, e.status, e.message, e.param, e.code))
    except Exception as e:  # noqa: BLE001 - reported to the client mid-stream
        logger.exception("generation failed mid-stream")
        yield sse.event(error_body(reply.path, 500, f"generation failed: {e}"))
    else:
        if reply.include_usage:
            ordered = [finals[i] for i in sorted(finals)]
            yield sse.event(reply.envelope([], usage=fmt.usage(ordered, reply.n)))
    yield sse.DONE


def _adds_something(choice: dict[str, Any]) -> bool:
    lp = choice.get("logprobs") or {}
    return bool(choice.get("text") or choice.get("delta") or choice.get("finish_reason")
                or lp.get("tokens") or lp.get("content"))

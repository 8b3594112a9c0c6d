"""The native API (SGLang's, field for field; see docs/api.md): `/generate` and the control routes.

`/generate` answers one object for one prompt and a list for a batch or `n > 1`; with `stream`
it sends SSE events whose `text` / `output_ids` are cumulative, each with `index` when there
are several sequences, then `data: [DONE]`. Logprobs stream as SGLang streams them: each
event's output lists hold its new entries (`output_token_logprobs_length` counts them all so
far) and its input lists are complete (`_InputLogprobs`). Control routes: model and server
info, health (with a one-token generation for `/health_generate`), prefix-cache flush, abort,
tokenizer round trip and Prometheus metrics. Errors are `{"error": {"message": ...}}` (see
`app.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

import arborlm
from arborlm.errors import InvalidRequestError
from arborlm.runtime import schema_report
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.server import sse
from arborlm.server.errors import ApiError
from arborlm.server.generation import Event, collect_finals, race_disconnect, started
from arborlm.server.jsonresp import JSONResponse
from arborlm.server.limits import HEALTH_GENERATE_TIMEOUT_S, MAX_DETOKENIZE_TOKENS
from arborlm.server.protocol import (
    AbortReqInput,
    DetokenizeInput,
    FlushCacheInput,
    GenerateReqInput,
    TokenizeInput,
)
from arborlm.server.state import ServerState, server_state

logger = logging.getLogger(__name__)
router = APIRouter()
ENGINE_INFO_TIMEOUT_S = 5.0


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateReqInput, request: Request) -> Response:
    state = server_state(request)
    req = body.to_generate_request()
    events = schema_report.attach(state.runner.events(req), req,
                                  state.engine_args.grammar_backend)
    if body.stream:
        stream = await started(request, events)
        return sse.SSEResponse(_native_stream(stream, _several(body, req)))
    finals = await race_disconnect(request, collect_finals(events))
    return JSONResponse(finals if req.is_batch or len(finals) != 1 else finals[0])


def _several(body: GenerateReqInput, req: GenerateRequest) -> bool:
    params = body.sampling_params
    rows = params if isinstance(params, list) else [params]
    return req.is_batch or any(p is not None and (p.n or 1) > 1 for p in rows)


async def _native_stream(stream: AsyncIterator[Event], several: bool) -> AsyncIterator[bytes]:
    inputs = _InputLogprobs()
    try:
        async with aclosing(stream):
            async for index, event in stream:
                event = inputs.complete(index, event)
                yield sse.event({**event, "index": index} if several else event)
    except InvalidRequestError as e:
        yield sse.error_event(e.message, 400)
    except ApiError as e:
        yield sse.error_event(e.message, e.status)
    except Exception as e:  # noqa: BLE001 - reported to the client mid-stream
        logger.exception("generation failed mid-stream")
        yield sse.error_event(f"generation failed: {e}", 500)
    yield sse.DONE


class _InputLogprobs:
    """Each streamed sequence's prompt logprobs so far, so that every event carries them all.

    The engine sends a prompt's entries once, in the events of its prefill; SGLang's streams
    repeat them in every event (only the output lists are per-event), and its frontend keeps
    just the latest event's `meta_info`, so ArborLM's native stream does the same.
    """

    KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, list]] = {}

    def complete(self, index: int, event: dict[str, Any]) -> dict[str, Any]:
        meta = event.get("meta_info")
        if not meta or not any(k in meta for k in self.KEYS):
            return event
        seen = self.seen.setdefault(index, {})
        meta = dict(meta)
        for key in self.KEYS:
            if key in meta:
                seen.setdefault(key, []).extend(meta[key] or [])
                meta[key] = seen[key]
        return {**event, "meta_info": meta}


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> Response:
    state = server_state(request)
    model = state.client.config.model
    return JSONResponse({
        "model_path": model.path, "tokenizer_path": state.client.config.tokenizer_path,
        "is_generation": True, "served_model_name": state.model_name,
        "architecture": model.architecture, "context_length": model.context_length,
        "vocab_size": model.vocab_size, "dtype": str(model.dtype).removeprefix("torch."),
        "has_image_understanding": False, "has_audio_understanding": False,
    })


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> Response:
    state = server_state(request)
    state.client.check_available()
    live = await _engine_info(state)
    if live is None:
        raise ApiError(503, "the engine is not responding")
    args = {**dataclasses.asdict(state.engine_args), **dataclasses.asdict(state.server_args)}
    args["model_path"] = state.client.config.model.path
    args["api_key"] = None if state.server_args.api_key is None else "<set>"
    return JSONResponse({**args, **live, "version": arborlm.__version__,
                         "served_model_name": state.model_name,
                         "num_sequences_in_flight": state.runner.gate.in_flight,
                         "engine_pids": state.client.pids(),
                         "engine_restarts": state.client.restarts,
                         "internal_states": [live]})


async def _engine_info(state: ServerState) -> dict[str, Any] | None:
    if not state.client.healthy():
        return None
    try:
        return await asyncio.wait_for(state.client.server_info(), ENGINE_INFO_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a dead or stuck engine has no figures to give
        return None


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine serves; 503 while it restarts (with `Retry-After`) or is dead."""
    server_state(request).client.check_available()
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    state = server_state(request)
    tok = state.tokenizer
    ids = [tok.bos_token_id] if tok.bos_token_id is not None else tok.encode("health")
    req = GenerateRequest(input_ids=ids, rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
                          sampling_params={"max_new_tokens": 1, "temperature": 0})
    try:
        await asyncio.wait_for(state.client.generate_all(req), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError as e:
        raise ApiError(503, f"no token generated within {HEALTH_GENERATE_TIMEOUT_S} s") from e
    except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
        raise ApiError(503, f"the engine cannot generate: {e}") from e
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, body: FlushCacheInput | None = None) -> Response:
    ok, message = await server_state(request).client.flush_cache()
    if not ok:
        raise ApiError(400, message)
    return JSONResponse({"success": True, "message": message})


@router.post("/abort_request")
async def abort_request(body: AbortReqInput, request: Request) -> Response:
    server_state(request).runner.abort(body.rid, body.abort_all)
    return JSONResponse({"success": True})


@router.post("/tokenize")
async def tokenize(body: TokenizeInput, request: Request) -> Response:
    state = server_state(request)
    encode = lambda text: list(state.tokenizer.encode(  # noqa: E731
        text, add_special_tokens=body.add_special_tokens))
    if isinstance(body.prompt, list):
        tokens: Any = [encode(p) for p in body.prompt]
        count: Any = [len(t) for t in tokens]
    else:
        tokens = encode(body.prompt)
        count = len(tokens)
    return JSONResponse({"tokens": tokens, "count": count,
                         "max_model_len": state.context_length})


@router.post("/detokenize")
async def detokenize(body: DetokenizeInput, request: Request) -> Response:
    state = server_state(request)
    rows = body.tokens if body.tokens and isinstance(body.tokens[0], list) else [body.tokens]
    vocab = state.client.config.model.vocab_size
    if sum(len(r) for r in rows) > MAX_DETOKENIZE_TOKENS:
        raise ApiError(400, f"at most {MAX_DETOKENIZE_TOKENS} tokens per request", "tokens")
    if any(not 0 <= t < vocab for row in rows for t in row):
        raise ApiError(400, f"tokens must be in [0, {vocab})", "tokens")
    texts = [state.tokenizer.decode(r, skip_special_tokens=body.skip_special_tokens)
             for r in rows]
    return JSONResponse({"text": texts if rows is body.tokens else texts[0]})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    payload = state.metrics.render(await _engine_info(state))
    return Response(payload, media_type="text/plain; version=0.0.4; charset=utf-8")

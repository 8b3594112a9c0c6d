"""HTTP error bodies: the native API's and OpenAI's, chosen by the route's path.

Native routes answer `{"error": {"message": ...}}`; `/v1/...` routes answer OpenAI's
`{"error": {"message", "type", "param", "code"}}`. `ApiError` carries a status, a message and
optionally the offending parameter; the app's exception handlers (see `app.py`) turn it,
`InvalidRequestError` and pydantic's validation errors into these bodies. Pydantic errors are
reduced to their most specific entry and named by the field path, with the value received.
A 503 says why in its OpenAI `code`: `overloaded` (the waiting queue is full),
`engine_restarting` (the engine died and is being started again; `Retry-After` says when to
retry) or `engine_unavailable` (the engine is not running).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.exceptions import RequestValidationError

from arborlm.errors import EngineDeadError, EngineRestartingError
from arborlm.server.jsonresp import JSONResponse

OPENAI_PREFIX = "/v1/"

_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 429: "rate_limit_error", 503: "server_error", 500: "server_error"}
_OPENAI_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                 413: "request_too_large", 429: "rate_limit_exceeded"}
# Union members and model names that pydantic puts in an error's location.
_NOT_A_FIELD = re.compile(r"^([A-Z]\w*|str|int|float|bool|list|dict|none|.*\[.*\]|"
                          r"function-\w+.*|constrained-\w+|literal.*|tagged-union.*)$")


class ApiError(Exception):
    """An HTTP error with a message for the client; `param` names the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX)


def encodable(text: str) -> str:
    """`text` with lone surrogates (which no JSON encoder writes) as `\\udXXX` escapes: error
    messages may quote what the client sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    message = encodable(message)
    param = None if param is None else encodable(param)
    if not is_openai_path(path):
        return {"error": {"message": message}}
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code or _OPENAI_CODES.get(status)}}


# Engine parameter names -> the OpenAI routes' names for the same thing.
_OPENAI_PARAMS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                  "sampling_seed": "seed", "top_logprobs_num": "top_logprobs"}
_PROMPT_PARAMS = ("text", "input_ids")


def invalid_request(path: str, message: str, param: str | None) -> ApiError:
    """A 400 for an engine `InvalidRequestError`, in the OpenAI routes' vocabulary there."""
    if not is_openai_path(path):
        return ApiError(400, message, param)
    names = dict(_OPENAI_PARAMS)
    prompt = "messages" if path.startswith("/v1/chat/") else "prompt"
    names.update({p: prompt for p in _PROMPT_PARAMS})
    for old, new in _OPENAI_PARAMS.items():
        message = re.sub(rf"\b{old}\b", new, message)
    return ApiError(400, message, names.get(param, param) if param else None)


def engine_unavailable(exc: EngineDeadError) -> ApiError:
    """The 503 for an engine that is restarting (with `Retry-After`) or not running."""
    if isinstance(exc, EngineRestartingError):
        retry = str(max(1, round(exc.retry_after_s)))
        return ApiError(503, str(exc), code="engine_restarting", headers={"Retry-After": retry})
    message = str(exc)
    if not message.startswith("the engine"):
        message = f"the engine is not running: {message}"
    return ApiError(503, message, code="engine_unavailable")


def error_response(path: str, err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(path, err.status, err.message, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def validation_error(exc: RequestValidationError) -> ApiError:
    """The most specific pydantic error as a 400 naming its field and the value received."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    best = max(errors, key=lambda e: len(_field_path(e.get("loc", ()))))
    path = _field_path(best.get("loc", ()))
    message = str(best.get("msg", "invalid value"))
    kind = best.get("type", "")
    if kind == "json_invalid":
        ctx = best.get("ctx") or {}
        return ApiError(400, f"the request body is not valid JSON: {ctx.get('error', message)}")
    if not path and kind in ("model_attributes_type", "dict_type"):
        return ApiError(400, "the request body must be a JSON object (send it with "
                        "'Content-Type: application/json')")
    if kind == "missing":
        return ApiError(400, f"{path}: field required", param=path or None)
    if kind == "extra_forbidden":
        return ApiError(400, f"{path}: unknown field", param=path or None)
    if kind == "value_error":
        message = message.removeprefix("Value error, ")
    elif "input" in best and kind not in ("model_attributes_type", "dict_type"):
        message += f" (got {_short(best['input'])})"
    if not path:
        return ApiError(400, f"request body: {message}")
    return ApiError(400, f"{path}: {message}", param=path)


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not _NOT_A_FIELD.match(str(item)):
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

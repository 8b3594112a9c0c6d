"""Server-sent events: `data: <json>\\n\\n` frames, the `[DONE]` terminator, and a streaming
response that always closes its event iterator.

Starlette's `StreamingResponse` stops iterating when the client disconnects but may leave the
iterator suspended; `SSEResponse` closes it when the response ends, however it ends, so the
engine request behind it is aborted at once rather than when the iterator is collected.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from arborlm.server.jsonresp import dumps

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: Any) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


def error_event(message: str, code: int) -> bytes:
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # no lone surrogates
    return event({"error": {"message": message, "code": code}})


class SSEResponse(StreamingResponse):
    def __init__(self, body: AsyncIterator[bytes]):
        super().__init__(body, media_type="text/event-stream", headers=HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with suppress(Exception):
                    await aclose()

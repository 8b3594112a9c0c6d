"""`JSONResponse` encoded with msgspec: fast, and never fails on a non-finite float.

Starlette's JSONResponse refuses NaN and infinities (a logprob can be -inf); msgspec writes
them as `null`. Routes that must give numbers there (OpenAI logprobs) clamp them first.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import JSONResponse as _StarletteJSONResponse

_encoder = msgspec.json.Encoder()


def dumps(content: Any) -> bytes:
    return _encoder.encode(content)


class JSONResponse(_StarletteJSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content)

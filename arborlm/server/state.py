"""`ServerState`: what the routes share — the engine client and the server's helpers.

Built once by `create_app` and stored on `app.state.arbor`; routes reach it with
`server_state(request)`. Holds no request state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from arborlm.runtime.config import EngineArgs
from arborlm.runtime.engine_client import EngineClient
from arborlm.server.chat import ChatRenderer
from arborlm.server.generation import GenerationRunner
from arborlm.server.metrics import ServerMetrics
from arborlm.server.server_args import ServerArgs
from arborlm.server.tokens import TokenTexts


@dataclass
class ServerState:
    client: EngineClient
    server_args: ServerArgs
    engine_args: EngineArgs
    runner: GenerationRunner
    metrics: ServerMetrics
    chat: ChatRenderer
    token_texts: TokenTexts
    model_name: str

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def context_length(self) -> int:
        return self.client.config.model.context_length


def server_state(request: Request) -> ServerState:
    return request.app.state.arbor

"""`RuntimeEndpoint`: programs run against an ArborLM server over HTTP (the native API).

Speaks the routes of docs/api.md — `POST /generate` (streaming as server-sent events),
`GET /get_model_info`, `GET /get_server_info`, `POST /flush_cache`, `POST /tokenize` — so it
also drives any server with SGLang's native API. Requests go through one `requests.Session`
per thread (programs and branches call from their own worker threads), with an optional
bearer `api_key`.

Tokenization (for `select`'s choice boundaries) and the chat template come from the model's
tokenizer when the server's `tokenizer_path` is a directory (or GGUF file) on this machine;
otherwise the server's `/tokenize` does the tokenizing and the registry picks a template by
model name.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from arborlm.lang.backends.native import NativeBackend
from arborlm.lang.chat_template import (
    ChatTemplate,
    get_chat_template,
    get_chat_template_by_model_path,
)
from arborlm.lang.errors import BackendError
from arborlm.lang.model_template import chat_template_from_tokenizer

CONNECT_TIMEOUT_S = 10.0
DEFAULT_TIMEOUT_S = 600.0


class RuntimeEndpoint(NativeBackend):
    def __init__(self, base_url: str, api_key: str | None = None, verify: Any = None,
                 chat_template_name: str | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = verify
        self.timeout = timeout
        self._local = threading.local()
        self.model_info = self._get("/get_model_info")
        self.model_path = self.model_info.get("model_path")
        self.tokenizer = _local_tokenizer(self.model_info)
        self.chat_template = self._pick_template(chat_template_name)
        self.prefix_cache_enabled = not self._server_flag("disable_radix_cache")

    def _server_flag(self, name: str) -> bool:
        """A boolean server argument from `/get_server_info` (False when not reported)."""
        try:
            return bool(self.get_server_info().get(name, False))
        except BackendError:
            return False

    def _pick_template(self, name: str | None) -> ChatTemplate:
        if name is not None:
            return get_chat_template(name)
        if self.tokenizer is not None:
            derived = chat_template_from_tokenizer(self.tokenizer)
            if derived is not None:
                return derived
        return get_chat_template_by_model_path(self.model_path)

    # --- HTTP -----------------------------------------------------------------------------------

    def _session(self) -> Any:
        session = getattr(self._local, "session", None)
        if session is None:
            import requests

            session = requests.Session()
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
            self._local.session = session
        return session

    def _call(self, method: str, route: str, body: Any = None, stream: bool = False) -> Any:
        import requests

        url = self.base_url + route
        try:
            resp = self._session().request(method, url, json=body, stream=stream,
                                           timeout=(CONNECT_TIMEOUT_S, self.timeout),
                                           verify=self.verify)
        except requests.RequestException as e:
            raise BackendError(f"{method} {url} failed: {e}") from e
        if resp.status_code != 200:
            raise BackendError(f"{method} {url}: HTTP {resp.status_code}: {_error_text(resp)}",
                               resp.status_code)
        return resp

    def _get(self, route: str) -> Any:
        return self._call("GET", route).json()

    def _post(self, route: str, body: Any) -> Any:
        return self._call("POST", route, body).json()

    # --- native API -----------------------------------------------------------------------------

    def request(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        return self._post("/generate", payload)

    def request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._call("POST", "/generate", payload, stream=True) as resp:
            for line in resp.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        if self.tokenizer is not None:
            return [list(self.tokenizer.encode(t)) for t in texts]
        out = self._post("/tokenize", {"prompt": texts, "add_special_tokens": True})
        return [list(ids) for ids in out["tokens"]]

    def flush_cache(self) -> bool:
        try:
            self._call("POST", "/flush_cache")
        except BackendError as e:
            if e.status_code == 400:  # requests in flight
                return False
            raise
        return True

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()


def _error_text(resp: Any) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)


def _local_tokenizer(model_info: dict[str, Any]) -> Any:
    """The server's tokenizer, when its directory (or GGUF file) exists on this machine; else
    None."""
    from arborlm.errors import ModelLoadError
    from arborlm.runtime.models.gguf.files import find_gguf_file
    from arborlm.runtime.tokenizer_utils import load_tokenizer

    path = model_info.get("tokenizer_path") or model_info.get("model_path")
    if not path:
        return None
    try:
        if (Path(path) / "tokenizer_config.json").is_file() or find_gguf_file(path):
            return load_tokenizer(path)
    except ModelLoadError:
        pass
    return None

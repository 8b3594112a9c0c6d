"""`RuntimeEndpoint(url, api_key=...)` against a server started with `--api-key`."""

from __future__ import annotations

import pytest

import arborlm.lang as sgl
from arborlm.lang.errors import BackendError
from tests.lang.conftest import GREEDY, REPO_ROOT


@pytest.fixture(scope="module")
def keyed_server(tiny_path):
    if not (REPO_ROOT / "arborlm" / "server" / "__main__.py").is_file():
        pytest.skip("this checkout has no HTTP server (arborlm/server/__main__.py)")
    from tests.server.server_process import running_server

    with running_server(tiny_path, "--api-key", "s3cret") as proc:
        yield proc


def test_api_key_is_sent_and_required(keyed_server):
    with pytest.raises(BackendError) as info:
        sgl.RuntimeEndpoint(keyed_server.url)
    assert info.value.status_code == 401

    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("x", max_tokens=3)
        s += sgl.select("c", choices=[" a", " b"])

    with sgl.RuntimeEndpoint(keyed_server.url, api_key="s3cret") as backend:
        state = prog.run(backend=backend, **GREEDY)
        assert state.error() is None and state["c"] in (" a", " b")
        assert sgl.flush_cache(backend)

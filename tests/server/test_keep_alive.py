"""Idle keep-alive connections outlive the clients' connection pools.

Regression test for: `benchmarks/soak.py` (200 clients, 10 minutes) lost 6 of 38,080 requests
with `httpx.ReadError` and nothing received. uvicorn closed an idle keep-alive connection after
its default 5 s, exactly as long as httpx (and so the openai client) keeps one pooled, and the
client's clock starts later than the server's: a client could send its request on a connection
the server was closing. The server now keeps idle connections `--timeout-keep-alive` seconds,
by default longer than the common clients' pool expiry.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx

from arborlm.server.server_args import ServerArgs
from tests.server.server_process import running_server

AIOHTTP_KEEPALIVE_S = 15.0  # aiohttp's TCPConnector default
CLOSE_DEADLINE_S = 60.0  # a connection still open after this was never closed


def test_default_keep_alive_outlives_client_pools():
    expiry = httpx.Limits().keepalive_expiry
    assert expiry is not None
    assert ServerArgs().timeout_keep_alive > max(expiry, AIOHTTP_KEEPALIVE_S)


def test_idle_connection_closes_after_timeout_keep_alive(make_tiny_model):
    with running_server(make_tiny_model("llama"), "--timeout-keep-alive", "1") as server:
        address = urlsplit(server.url)
        with socket.create_connection((address.hostname, address.port),
                                      timeout=CLOSE_DEADLINE_S) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: arborlm\r\n\r\n")
            answered = time.monotonic()
            data = b""
            while chunk := sock.recv(4096):  # until the server closes the idle connection
                data += chunk
            idle = time.monotonic() - answered
    assert data.startswith(b"HTTP/1.1 200"), data
    assert 0.9 <= idle < CLOSE_DEADLINE_S, idle

"""The text the router routes a request on, per route and prompt shape."""

from __future__ import annotations

import pytest

from arborlm.routing.policy import ids_text
from arborlm.routing.router_app import routing_text

CASES = [
    ("/generate", {"text": "hello"}, "hello"),
    ("/generate", {"text": ["first", "second"]}, "first"),
    ("/generate", {"input_ids": [5, 6, 7]}, ids_text([5, 6, 7])),
    ("/generate", {"input_ids": [[5, 6], [7]]}, ids_text([5, 6])),
    ("/generate", {"text": 3}, ""),
    ("/generate", {}, ""),
    ("/v1/completions", {"prompt": "p"}, "p"),
    ("/v1/completions", {"prompt": ["p1", "p2"]}, "p1"),
    ("/v1/completions", {"prompt": [1, 2]}, ids_text([1, 2])),
    ("/v1/completions", {"prompt": [-1]}, ""),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "sys"},
                                           {"role": "user", "content": [
                                               {"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}]}, "sys\nab"),
    ("/v1/chat/completions", {"messages": "not a list"}, ""),
    ("/v1/chat/completions", {"messages": [None, {"content": None}]}, ""),
]


@pytest.mark.parametrize("path,payload,text", CASES)
def test_routing_text(path, payload, text):
    assert routing_text(path, payload) == text

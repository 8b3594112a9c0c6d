"""Schema-driven fuzzing of every route (schemathesis over the server's own OpenAPI schema).

Each operation of `/openapi.json` gets `$ARBORLM_FUZZ_EXAMPLES` generated requests (default 20
here, so the suite stays short), valid and invalid by the schema (schemathesis' positive and
negative modes): no answer may be a 5xx other than the bounded queue's 503 with `Retry-After`,
and the server must stay healthy with the same engine processes throughout. The run beyond CI
(docs/serving.md) sets the variable to 1,000: ~20,000 requests over the routes.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.server_process import running_server

EXAMPLES = int(os.environ.get("ARBORLM_FUZZ_EXAMPLES", "20"))
CALL_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def fuzz_server(make_tiny_model):
    with running_server(make_tiny_model("llama"), "--context-length", "256",
                        "--max-running-requests", "4") as srv:
        yield srv


def _operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_no_route_answers_a_server_error(fuzz_server, mode):
    operations = _operations(fuzz_server.url)
    assert len(operations) >= 10, [op.label for op in operations]
    calls = []

    for operation in operations:
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case, operation=operation):
            response = case.call(base_url=fuzz_server.url, timeout=CALL_TIMEOUT_S)
            calls.append(operation.label)
            overloaded = response.status_code == 503 and "Retry-After" in response.headers
            assert response.status_code < 500 or overloaded, (
                operation.label, case.body, case.query, response.status_code,
                response.text[:500])

        fuzz()
    assert len(set(calls)) == len(operations)
    assert httpx.get(fuzz_server.url + "/health", timeout=60).status_code == 200
    assert all(child.is_running() for child in fuzz_server.children), "an engine process died"

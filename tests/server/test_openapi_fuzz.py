"""Schema-driven fuzzing of every route (schemathesis over the server's own OpenAPI schema).

Each operation of `/openapi.json` gets up to `$ARBORLM_FUZZ_EXAMPLES` generated requests
(default 20 here, so the suite stays short), valid and invalid by the schema (schemathesis'
positive and negative modes; an operation whose inputs are few, such as a GET without
parameters, runs out of distinct cases sooner): no answer may be a 5xx other than a 503 with
`Retry-After` (the bounded queue), no request may go unanswered for `CALL_TIMEOUT_S`, and the
server must stay healthy with the same engine processes throughout. Each mode prints the
requests it sent by operation and by status, and the module the totals, so that a long run
(docs/serving.md, "Soak and fuzz runs") leaves its figures on record.
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from tests.server.server_process import running_server

EXAMPLES = int(os.environ.get("ARBORLM_FUZZ_EXAMPLES", "20"))
CALL_TIMEOUT_S = 300.0  # an answer later than this is a hang
PROGRESS_EVERY = 1000  # requests between progress lines (seen with `pytest -s`)


@pytest.fixture(scope="module")
def fuzz_server(make_tiny_model):
    with running_server(make_tiny_model("llama"), "--context-length", "256",
                        "--max-running-requests", "4") as srv:
        yield srv


@pytest.fixture(scope="module")
def totals():
    """Requests sent by every mode, by status; printed once the module is done."""
    counts: Counter = Counter()
    yield counts
    print(f"\nfuzz total: {sum(counts.values())} requests; by status: {_by_status(counts)}")


def _by_status(counts: Counter) -> str:
    return ", ".join(f"{status}: {n}" for status, n in sorted(counts.items(), key=str))


def _operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(operation, mode, url: str, sent: Counter, statuses: Counter) -> None:
    """Run `operation`'s generated cases against `url`; count what was sent and answered.
    (A function per operation: hypothesis refuses a `@given` test with default arguments, the
    usual way to bind a loop variable.)"""
    label = operation.label

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        sent[label] += 1
        if sum(sent.values()) % PROGRESS_EVERY == 0:
            print(f"\n{mode.value}: {sum(sent.values())} requests sent, now {label}", flush=True)
        try:
            response = case.call(base_url=url, timeout=CALL_TIMEOUT_S)
        except Exception:
            statuses["no answer"] += 1
            raise
        statuses[response.status_code] += 1
        overloaded = response.status_code == 503 and "Retry-After" in response.headers
        assert response.status_code < 500 or overloaded, (
            label, case.body, case.query, response.status_code, response.text[:500])

    try:
        fuzz()
    except Unsatisfiable:  # no invalid input exists: an operation that takes none
        assert mode == schemathesis.GenerationMode.NEGATIVE and not sent[label], label
        sent[label] += 0  # listed, with no request


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_no_route_answers_a_server_error(fuzz_server, totals, mode):
    operations = _operations(fuzz_server.url)
    assert len(operations) >= 10, [op.label for op in operations]
    sent: Counter = Counter()  # operation -> requests sent
    statuses: Counter = Counter()  # status -> answers ("no answer" when the call raised)
    for operation in operations:
        _fuzz(operation, mode, fuzz_server.url, sent, statuses)
    totals.update(statuses)
    print(f"\n{mode.value}: {sum(sent.values())} requests; by status: {_by_status(statuses)}")
    print("  by operation (0: no invalid input exists): "
          + ", ".join(f"{op} {n}" for op, n in sorted(sent.items())))
    assert set(sent) == {op.label for op in operations}
    assert httpx.get(fuzz_server.url + "/health", timeout=60).status_code == 200
    assert all(child.is_running() for child in fuzz_server.children), "an engine process died"

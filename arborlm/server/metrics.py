"""Prometheus metrics of the server (`GET /metrics`), on a registry of its own.

Counted at the edge: HTTP requests by route and status, finished sequences by finish reason,
prompt / generated / cached tokens, and latency histograms per sequence — time to first token,
inter-token latency, time per output token, end-to-end latency. Read from the engine at each
scrape: running and queued requests, KV usage, the prefix-cache hit rate and how many times
the engine's processes were started again after dying (`arborlm:engine_restarts_total`), and
speculative decoding's drafts, draft tokens and accepted draft tokens. Names
use the `arborlm:` prefix, as vLLM and SGLang use theirs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

PREFIX = "arborlm:"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class _RestartCounter:
    """`engine_restarts_total`, read from the engine client at each scrape."""

    def __init__(self, read: Callable[[], int]):
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(f"{PREFIX}engine_restarts", "Times the engine's processes "
                                  "were started again after one died", value=self.read())


# Engine counters of speculative decoding: (metric name, `get_server_info` key, help).
SPEC_COUNTERS = (
    ("spec_drafts", "spec_drafts", "Speculative drafts verified (one per request and step)"),
    ("spec_draft_tokens", "spec_draft_tokens", "Speculative draft tokens proposed"),
    ("spec_accepted_tokens", "spec_accepted_tokens", "Speculative draft tokens accepted"),
    ("spec_grammar_pruned_tokens", "spec_grammar_pruned_tokens",
     "Speculative draft tokens cut because the request's grammar rejects them"),
    ("spec_grammar_forced_tokens", "spec_grammar_forced_tokens",
     "Speculative draft tokens added because the request's grammar forces them"),
    ("spec_grammar_spelled_tokens", "spec_grammar_spelled_tokens",
     "Speculative draft tokens added that spell the string the request's grammar forces"),
)


class _EngineCounters:
    """Counters the engine keeps (`SPEC_COUNTERS`), as of the last scrape's engine info."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, key, text in SPEC_COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}{name}", text, value=self.info.get(key, 0))


class ServerMetrics:
    def __init__(self, model_name: str, engine_restarts: Callable[[], int] = lambda: 0):
        self.registry = CollectorRegistry()
        r, m = self.registry, PREFIX
        self.http_requests = Counter(f"{m}http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.finished = Counter(f"{m}requests", "Finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{m}prompt_tokens", "Prompt tokens of finished sequences",
                                     registry=r)
        self.generation_tokens = Counter(f"{m}generation_tokens", "Generated tokens",
                                         registry=r)
        self.cached_tokens = Counter(f"{m}cached_tokens", "Prompt tokens served from the "
                                     "prefix cache", registry=r)
        hist = dict(buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(f"{m}time_to_first_token_seconds", "Time to first token", **hist)
        self.itl = Histogram(f"{m}inter_token_latency_seconds", "Time between output tokens",
                             **hist)
        self.tpot = Histogram(f"{m}time_per_output_token_seconds", "Mean time per output token "
                              "after the first, per sequence", **hist)
        self.e2e = Histogram(f"{m}e2e_request_latency_seconds", "End-to-end sequence latency",
                             **hist)
        self.in_flight = Gauge(f"{m}num_sequences_in_flight", "Sequences admitted by the server "
                               "and not finished", registry=r)
        self.running = Gauge(f"{m}num_running_reqs", "Requests the engine is running",
                             registry=r)
        self.queued = Gauge(f"{m}num_queue_reqs", "Requests waiting in the engine", registry=r)
        self.hit_rate = Gauge(f"{m}cache_hit_rate", "Prompt tokens served from the prefix cache "
                              "/ all prompt tokens", registry=r)
        self.kv_usage = Gauge(f"{m}kv_cache_usage", "Fraction of the KV pool in use by running "
                              "requests", registry=r)
        info = Gauge(f"{m}model_info", "The served model", ["model_name"], registry=r)
        info.labels(model_name=model_name).set(1)
        r.register(_RestartCounter(engine_restarts))
        self.engine_counters = _EngineCounters()
        r.register(self.engine_counters)

    def observer(self) -> SequenceObserver:
        return SequenceObserver(self, time.monotonic())

    def render(self, engine_info: dict[str, Any] | None) -> bytes:
        """Prometheus text, with the engine gauges refreshed from `engine_info` when given."""
        if engine_info is not None:
            self.running.set(engine_info.get("num_running_reqs", 0))
            self.queued.set(engine_info.get("num_waiting_reqs", 0))
            self.hit_rate.set(engine_info.get("cache_hit_rate", 0.0))
            total = engine_info.get("max_total_num_tokens") or 0
            free = engine_info.get("available_kv_tokens", total)
            cached = engine_info.get("cached_kv_tokens", 0)
            self.kv_usage.set((total - free - cached) / total if total else 0.0)
            self.engine_counters.info = engine_info
        return generate_latest(self.registry)


@dataclass
class _Seq:
    tokens: int = 0
    first: float | None = None
    last: float = 0.0
    done: bool = False


class SequenceObserver:
    """Feeds one request's events (index, native event) into the metrics."""

    def __init__(self, metrics: ServerMetrics, start: float):
        self.metrics = metrics
        self.start = start
        self.seqs: dict[int, _Seq] = {}

    def close(self, sequences: int) -> None:
        """The request ended: sequences that never finished (their client left, or the server
        stopped) count as aborted."""
        unfinished = sequences - sum(1 for s in self.seqs.values() if s.done)
        if unfinished > 0:
            self.metrics.finished.labels(finish_reason="abort").inc(unfinished)

    def event(self, index: int, event: dict[str, Any]) -> None:
        now = time.monotonic()
        meta = event["meta_info"]
        seq = self.seqs.setdefault(index, _Seq())
        tokens = meta.get("completion_tokens", 0)
        new = tokens - seq.tokens
        m = self.metrics
        if new > 0:
            if seq.first is None:
                seq.first = now
                m.ttft.observe(now - self.start)
            else:
                m.itl.observe((now - seq.last) / new)
            seq.last, seq.tokens = now, tokens
        reason = meta.get("finish_reason")
        if reason is None:
            return
        seq.done = True
        m.finished.labels(finish_reason=reason.get("type", "unknown")).inc()
        m.e2e.observe(now - self.start)
        m.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        m.generation_tokens.inc(tokens)
        m.cached_tokens.inc(meta.get("cached_tokens", 0))
        if tokens > 1 and seq.first is not None:
            m.tpot.observe((now - seq.first) / (tokens - 1))

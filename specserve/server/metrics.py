"""Request telemetry: Prometheus metrics for /metrics and one log line per request.

Engine gauges and speculative counters are read at scrape time from the engine thread's latest snapshot
(the engine itself is never touched from here); request counters and latency histograms are recorded when
an HTTP request ends. Names follow vLLM's with a `specserve:` prefix. Each server has its own registry, so
several can live in one process (the tests start many).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.server.async_engine import EngineSnapshot, EngineUpdate
from specserve.server.protocol import Usage

logger = logging.getLogger(__name__)

# How an HTTP request to /v1 ended.
OUTCOMES = ("completed", "aborted", "error", "invalid", "rejected", "unauthorized", "unavailable")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


def outcome_of_status(status: int) -> str:
    if status == 401:
        return "unauthorized"
    if status == 429:
        return "rejected"
    if status == 503:
        return "unavailable"
    return "error" if status >= 500 else "invalid"


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "specserve:requests", "HTTP requests to /v1 by outcome", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter(
            "specserve:prompt_tokens", "Prompt tokens of ended requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "specserve:generation_tokens", "Generated tokens of ended requests", registry=self.registry
        )
        self.ttft = Histogram(
            "specserve:time_to_first_token_seconds",
            "Arrival at the server to the first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "specserve:time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per completion",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "specserve:e2e_request_latency_seconds",
            "Arrival at the server to the last token, per completion",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(snapshot))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def record_request(
        self, request_id: str, arrival: float, updates: Iterable[EngineUpdate], usage: Usage, outcome: str
    ) -> None:
        """Count an ended generation request, time its completions, and log its line."""
        updates = list(updates)
        self.count(outcome)
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        for u in updates:
            m = u.metrics
            if u.output.finish_reason not in ("stop", "length") or m.first_token_time is None:
                continue  # aborted or failed: its timings describe the interruption, not the service
            self.ttft.observe(m.first_token_time - arrival)
            self.e2e.observe(m.finish_time - arrival)
            if len(u.output.token_ids) > 1:
                self.tpot.observe((m.finish_time - m.first_token_time) / (len(u.output.token_ids) - 1))
        _log_request(request_id, arrival, updates, usage, outcome)


def _log_request(
    request_id: str, arrival: float, updates: list[EngineUpdate], usage: Usage, outcome: str
) -> None:
    elapsed = time.monotonic() - arrival
    first_tokens = [u.metrics.first_token_time for u in updates if u.metrics.first_token_time is not None]
    ttft = f"{min(first_tokens) - arrival:.3f}s" if first_tokens else "-"
    drafts = sum(u.num_drafts for u in updates)
    tau = f"{1 + sum(u.num_accepted_tokens for u in updates) / drafts:.2f}" if drafts else "-"
    logger.info(
        "%s %s: %d prompt tokens, %d output tokens, TTFT %s, %.1f tokens/s, tau %s",
        request_id,
        outcome,
        usage.prompt_tokens,
        usage.completion_tokens,
        ttft,
        usage.completion_tokens / elapsed if elapsed > 0 else 0.0,
        tau,
    )


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        yield GaugeMetricFamily(
            "specserve:num_requests_running", "Requests in the running batch", value=snap.num_running
        )
        yield GaugeMetricFamily(
            "specserve:num_requests_waiting", "Requests waiting to be scheduled", value=snap.num_waiting
        )
        yield GaugeMetricFamily(
            "specserve:kv_cache_used_blocks", "KV cache blocks in use", value=snap.num_used_blocks
        )
        yield GaugeMetricFamily("specserve:kv_cache_total_blocks", "KV cache blocks", value=snap.num_blocks)
        yield CounterMetricFamily(
            "specserve:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=snap.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "specserve:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            value=snap.prefix_cache_hits,
        )
        spec = snap.spec
        yield CounterMetricFamily(
            "specserve:spec_decode_num_drafts", "Verification rounds with draft tokens", value=spec.num_drafts
        )
        yield CounterMetricFamily(
            "specserve:spec_decode_num_draft_tokens", "Draft tokens verified", value=spec.num_draft_tokens
        )
        yield CounterMetricFamily(
            "specserve:spec_decode_num_accepted_tokens",
            "Draft tokens accepted",
            value=spec.num_accepted_tokens,
        )
        yield _per_position(
            CounterMetricFamily,
            "specserve:spec_decode_num_accepted_tokens_per_pos",
            "Rounds accepting the draft token at each position (0 = first draft token)",
            spec.accepted_per_position,
        )
        yield _per_position(
            GaugeMetricFamily,
            "specserve:spec_decode_calibration_ece",
            "Live ECE of the predicted draft survival at each position (drafters with a confidence head)",
            snap.calibration_ece,
        )


def _per_position(family, name: str, documentation: str, values: list) -> Metric:
    """One sample per draft position (label `position`, 0 = the first draft token)."""
    metric = family(name, documentation, labels=["position"])
    for position, value in enumerate(values):
        metric.add_metric([str(position)], value)
    return metric

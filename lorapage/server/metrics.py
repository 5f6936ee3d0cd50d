"""Prometheus metrics of one server, in a registry of its own (several servers can share a process).

Latencies are labelled by tenant and by the tier the adapter was in when the request arrived
(``gpu``, ``ram``, ``disk``; ``none`` for the base model), which is what tells a cold adapter's
first token from a warm one's. Engine gauges are read from ``Engine.stats()`` at scrape time.
"""

from __future__ import annotations

import re
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_NAME = re.compile(r"[^a-zA-Z0-9_]")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineGauges:
    """Exports every number in ``stats()`` as ``lorapage_engine_<key>`` when scraped."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self):
        for key, value in self._stats().items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = "lorapage_engine_" + _NAME.sub("_", key)
            yield GaugeMetricFamily(name, f"Engine.stats()['{key}']", value=value)


class ServerMetrics:
    """The histograms and counters the server updates as requests run."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        labels = ("tenant", "adapter_tier")
        self.ttft = Histogram(
            "lorapage_time_to_first_token_seconds", "Arrival to first generated token.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "lorapage_inter_token_latency_seconds", "Time between consecutive generated tokens.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "lorapage_request_latency_seconds", "Arrival to last token.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "lorapage_prompt_tokens", "Prompt tokens of requests that started generating.", ("tenant",),
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "lorapage_generation_tokens", "Generated tokens.", ("tenant",), registry=self.registry
        )
        self.requests = Counter(
            "lorapage_requests", "Requests answered, by route and status.", ("route", "status"),
            registry=self.registry,
        )
        self.registry.register(_EngineGauges(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

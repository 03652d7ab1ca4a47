"""The server's Prometheus metrics: stored counters and histograms, plus gauges read at scrape
time."""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from speceyes.types import PHASES, ROUTES

STATUSES: tuple[str, ...] = (
    "200", "400", "401", "408", "413", "415", "429", "500", "503", "504",
)  # fmt: skip
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The server's counters and histograms (prometheus-client), in a registry of their own so
    that several apps in one process never share a series."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "speceyes_requests", "Chat completion requests by HTTP status.", ["status"], registry=r
        )
        self.routes = Counter(
            "speceyes_routes", "Answered queries by funnel route.", ["route"], registry=r
        )
        self.batch_errors = Counter(
            "speceyes_batch_errors", "Funnel batches that raised.", registry=r
        )
        self.abandoned = Counter(
            "speceyes_abandoned",
            "Queries the funnel dropped unstarted because their request had timed out.",
            registry=r,
        )
        self.phases = Histogram(
            "speceyes_phase_seconds",
            "Funnel time per query and phase (a batch's phase time shared among its queries).",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "speceyes_request_seconds",
            "End-to-end latency of answered chat completion requests.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "speceyes_batch_size", "Queries per funnel batch.", buckets=BATCH_BUCKETS, registry=r
        )
        # Known label values start at zero so that rates exist before the first event.
        for status in STATUSES:
            self.requests.labels(status=status)
        for route in ROUTES:
            self.routes.labels(route=route)
        for phase in PHASES:
            self.phases.labels(phase=phase)

    def render(
        self,
        gauges: dict[str, tuple[str, float | None]],
        counters: dict[str, tuple[str, float]] | None = None,
    ) -> bytes:
        """The text exposition: the stored series plus values read now (None is NaN)."""
        now = CollectorRegistry()
        now.register(_Snapshot(gauges, counters or {}))
        return generate_latest(self.registry) + generate_latest(now)


class _Snapshot(Collector):
    """Gauges and counters whose values the server holds elsewhere, read at scrape time."""

    def __init__(
        self, gauges: dict[str, tuple[str, float | None]], counters: dict[str, tuple[str, float]]
    ) -> None:
        self.gauges, self.counters = gauges, counters

    def collect(self) -> Iterator[Metric]:
        for name, (help_, value) in self.counters.items():
            yield CounterMetricFamily(name, help_, value=value)
        for name, (help_, value) in self.gauges.items():
            yield GaugeMetricFamily(name, help_, value=math.nan if value is None else value)

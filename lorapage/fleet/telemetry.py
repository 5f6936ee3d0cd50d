"""What the ingress knows of each engine replica: its latest heartbeat, re-exported.

Each replica's :class:`~lorapage.fleet.messages.Heartbeat` carries its ``Engine.stats()`` and its
engine series as Prometheus text. The ingress keeps the latest one per replica and drops a
replica silent for ``STALE_BEATS`` periods (it died; Ray replaces it under a new id). ``/metrics``
re-exports every live replica's series with a ``replica`` label, beside the ingress's own (requests,
latencies as clients saw them, quotas), the way a Prometheus federation would, so one scrape of the
fleet's address sees all of it; ``/internal/state`` shows the stats, and the admin routes read an
adapter's tier on each replica from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from lorapage.fleet.messages import Heartbeat

STALE_BEATS = 3  # heartbeats missed before a replica counts as gone


@dataclass(frozen=True)
class _Report:
    beat: Heartbeat
    received: float


class ReplicaReports:
    """The latest heartbeat of every live replica, as a Prometheus collector too."""

    def __init__(self, period_s: float, clock: Callable[[], float]) -> None:
        self.max_age_s = STALE_BEATS * period_s
        self._clock = clock
        self._reports: dict[str, _Report] = {}

    def record(self, beat: Heartbeat) -> None:
        self._reports[beat.replica_id] = _Report(beat, self._clock())

    def live(self) -> dict[str, Heartbeat]:
        """Replica id -> its latest heartbeat, for the replicas heard from lately."""
        now = self._clock()
        for rid in [r for r, rep in self._reports.items() if now - rep.received > self.max_age_s]:
            del self._reports[rid]
        return {rid: rep.beat for rid, rep in sorted(self._reports.items())}

    def tiers(self, key: str) -> dict[str, str]:
        """Where version ``key`` is on each live replica that holds it: ``gpu`` (pool) or ``ram``."""
        out = {}
        for rid, beat in self.live().items():
            if key in beat.stats.resident_adapters:
                out[rid] = "gpu"
            elif key in beat.stats.host_ram_adapters:
                out[rid] = "ram"
        return out

    def collect(self) -> Iterator[Metric]:
        live = self.live()
        now = self._clock()
        count = GaugeMetricFamily("lorapage_fleet_replicas", "Engine replicas heard from lately.", value=len(live))
        yield count
        age = GaugeMetricFamily(
            "lorapage_fleet_replica_report_age_seconds",
            "Seconds since each replica's heartbeat, whose series are re-exported here.",
            labels=("replica",),
        )
        for rid in live:
            age.add_metric([rid], now - self._reports[rid].received)
        yield age
        merged: dict[str, Metric] = {}
        for rid, beat in live.items():
            for family in text_string_to_metric_families(beat.metrics.decode()):
                if family.name.endswith("_created"):
                    continue  # client-library timestamps; meaningless across processes
                out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "replica": rid}, sample.value)
        yield from merged.values()

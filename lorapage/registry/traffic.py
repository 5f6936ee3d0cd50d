"""The registry's hourly traffic table as the traffic tiers read and write it
(:class:`~lorapage.engine.tiering.TrafficStore`): an engine's registry, or a fleet's at its ingress."""

from __future__ import annotations

from collections.abc import Sequence

from lorapage.registry.store import Registry, TrafficRow


class RegistryTraffic:
    """``registry``'s traffic table, for a tier keeper (blocking: it calls from an I/O thread)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def keep_traffic(
        self, rows: list[TrafficRow], hour: int, retention_hours: int, *, audit_before: float | None = None
    ) -> None:
        """Add ``rows`` to the hourly traffic table (hours past ``retention_hours`` deleted) and drop
        the audit rows older than ``audit_before``, if given (the tier keeper's upkeep)."""
        if rows:
            self.registry.add_traffic(rows, hour, retention_hours)
        if audit_before is not None:
            self.registry.prune_audit(audit_before)

    def requests_by_version(self, weights: Sequence[tuple[int, float, float]]) -> dict[str, tuple[float, float]]:
        """Every version's requests, weighted per hour (:meth:`Registry.weighted_requests`)."""
        return self.registry.weighted_requests(weights)

    def traffic_rows(self, since_hour: int, adapter_id: str | None = None) -> list[TrafficRow]:
        """The traffic rows from hour ``since_hour`` on, of ``adapter_id`` or of every id."""
        return self.registry.traffic(since_hour, adapter_id)

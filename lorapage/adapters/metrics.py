"""Per-adapter counters with a bounded label set: the top adapters by recent traffic by name, the
rest together as ``other``.

Counted by the adapter cache: requests by the tier their adapter was in when they arrived, loads
into the pool and their seconds by the tier they started from (``ram``, ``disk``, ``remote``), and
pool evictions. Read at scrape time: each id's projected cost (its current version's, from the
registry), exported by name for the labelled ids and as a histogram over every id. Labels are
adapter ids, not versions (``acme@3`` counts as ``acme``), so a deploy does not mint new series.

Cardinality rule: at most ``top_k`` adapter labels plus ``other``. An event is counted under its
adapter's own label when that adapter is labelled at the time, else under ``other``, so every
series only ever grows. The labelled set is the ``top_k`` ids by request rate (decayed with a
half-life of :data:`TRAFFIC_HALF_LIFE_S`), chosen again every :data:`LABEL_REFRESH_S`; until
``top_k`` ids are labelled a new id gets its label at once. An id that drops out loses its
series (if it comes back its counts restart from zero, which Prometheus reads as a counter
reset). Pure: the caller passes ``now``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping

from lorapage.adapters.names import OTHER, parse_name
from lorapage.scheduler.metrics import Histogram
from lorapage.usage import UsageLedger

LABEL_REFRESH_S = 60.0  # the labelled set is chosen again this often
TRAFFIC_HALF_LIFE_S = 300.0  # "recent traffic": request counts halve in weight every 5 minutes
MAX_TRACKED_FACTOR = 16  # traffic is tracked for at most this many times top_k ids
MAX_PENDING_LOADS = 4096  # versions whose pending load is charged to a tenant (the oldest forgotten past it)
# Buckets of the projected-cost histogram (% of the base's decode bytes at the reference batch).
COST_BOUNDS_PCT = (1.0, 2.5, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)
LOAD_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AdapterMetrics:
    """Counters by adapter label (see the module docstring for which ids get one), plus the
    readers the exporter calls at scrape time for what lives elsewhere."""

    def __init__(
        self,
        top_k: int = 20,
        *,
        bytes_downloaded: Callable[[], Mapping[str, int]] = dict,
        pinned_pages: Callable[[], int] = int,
        usage: UsageLedger | None = None,
        projected_costs: Callable[[], Mapping[str, float]] = dict,
    ) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1; got {top_k}")
        self.top_k = top_k
        self.bytes_downloaded = bytes_downloaded  # by scheme: the adapter sources' counters
        self.pinned_pages = pinned_pages  # pool pages held by admin pins now
        self.usage = usage  # loads are also charged to their version there
        self.projected_costs = projected_costs  # adapter id -> its current version's projected cost (%)
        self.requests: Counter[tuple[str, str]] = Counter()  # (label, tier at arrival) -> requests
        self.loads: Counter[tuple[str, str]] = Counter()  # (label, load tier) -> loads into the pool
        self.evictions: Counter[str] = Counter()  # label -> pool evictions
        # Swap traffic per tenant: a load's bytes go to the tenant whose request found the version
        # outside the pool first (a load nobody waited on, a pin or a hot keep, goes to nobody).
        self.load_bytes_by_tenant: Counter[str] = Counter()
        self._load_for: dict[str, str] = {}  # version -> tenant its pending load is charged to
        self.load_seconds = {tier: Histogram(LOAD_BOUNDS_S) for tier in ("ram", "disk", "remote")}
        self._traffic: dict[str, tuple[float, float]] = {}  # id -> (decayed requests, as of when)
        self.labelled: frozenset[str] = frozenset()
        self._refreshed = -math.inf

    # -- events ---------------------------------------------------------------------------------

    def record_request(self, name: str, tier: str, now: float, tenant: str | None = None) -> None:
        """A request for ``name`` (from ``tenant``) arrived while its adapter was in ``tier`` (gpu,
        ram, disk, loading...): outside the pool, the load it waits on is charged to ``tenant``
        unless an earlier request's already is."""
        if tier != "gpu" and tenant is not None and name not in self._load_for:
            self._load_for[name] = tenant
            if len(self._load_for) > MAX_PENDING_LOADS:  # loads that never completed (failed, deleted)
                del self._load_for[next(iter(self._load_for))]
        aid, _ = parse_name(name)
        count, at = self._traffic.get(aid, (0.0, now))
        self._traffic[aid] = (_decay(count, now - at) + 1.0, now)
        if now - self._refreshed >= LABEL_REFRESH_S:
            self._refresh(now)
        elif aid not in self.labelled and len(self.labelled) < self.top_k:
            self.labelled = self.labelled | {aid}
        self.requests[(self.label(name), tier)] += 1

    def record_load(self, name: str, tier: str, seconds: float, nbytes: int = 0, now: float = 0.0) -> None:
        """A load of ``name`` into the pool from ``tier`` (ram, disk, remote) took ``seconds``
        (its own work: waiting for room in the pool is not counted) and moved ``nbytes``."""
        self.loads[(self.label(name), tier)] += 1
        self.load_seconds[tier].observe(seconds)
        tenant = self._load_for.pop(name, None)
        if tenant is not None:
            self.load_bytes_by_tenant[tenant] += nbytes
        if self.usage is not None:
            self.usage.record_load(now, name, nbytes, seconds)

    def forget_load(self, name: str) -> None:
        """``name``'s pending load failed or the version is gone: nobody is charged for it."""
        self._load_for.pop(name, None)

    def record_eviction(self, name: str) -> None:
        self.evictions[self.label(name)] += 1

    def label(self, name: str) -> str:
        aid, _ = parse_name(name)
        return aid if aid in self.labelled else OTHER

    # -- the labelled set -----------------------------------------------------------------------

    def _refresh(self, now: float) -> None:
        """Label the ``top_k`` ids by recent traffic; forget ids with none, and the series of ids
        that lost their label."""
        rates = {aid: _decay(count, now - at) for aid, (count, at) in self._traffic.items()}
        ranked = sorted((aid for aid, r in rates.items() if r >= 1e-3), key=lambda a: (-rates[a], a))
        ranked = ranked[: self.top_k * MAX_TRACKED_FACTOR]
        self._traffic = {aid: (rates[aid], now) for aid in ranked}
        self.labelled = frozenset(ranked[: self.top_k])
        self._refreshed = now
        keep = self.labelled | {OTHER}
        for counter in (self.requests, self.loads):
            for key in [k for k in counter if k[0] not in keep]:
                del counter[key]
        for name in [k for k in self.evictions if k not in keep]:
            del self.evictions[name]


def _decay(count: float, elapsed: float) -> float:
    return count * math.exp2(-max(elapsed, 0.0) / TRAFFIC_HALF_LIFE_S)

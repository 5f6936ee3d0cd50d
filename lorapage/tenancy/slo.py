"""Per-tenant SLOs: each tenant's targets, and over a sliding window its goodput, error ratio and
burn rates (pure: every call takes ``now``; no clock, no exporter).

A tenant's targets (the tenants file's ``slo_*`` fields, :class:`SloTargets`) name three SLIs,
each judged per answered request:

- ``ttft``: time to first token within ``ttft_p95_s`` for 95% of the requests that got a first token;
- ``itl``: mean inter-token latency (the gaps ``lorapage_inter_token_latency_seconds`` observes,
  averaged over the request) within ``itl_p95_s`` for 95% of the requests with two tokens or more;
- ``error``: at most ``error_rate`` of the answered requests fail (a server error: 5xx, or an error
  event in a stream that had started).

A request is *good* (goodput) when it did not fail and met every latency target its tenant sets.
The *burn rate* of an SLI is, in the SRE workbook's sense, the observed bad fraction over the
allowed one (5% for a p95 target, ``error_rate`` for errors): 1 spends the error budget exactly
as fast as the SLO allows, 14.4 spends a 30-day budget's 2% in one hour (the usual page).

Each tenant's window is a ring of fixed time buckets, so memory is the same at any request rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

LATENCY_QUANTILE = 0.95  # the p95 of slo_ttft_p95_s and slo_itl_p95_s: 5% of requests may miss
DEFAULT_WINDOW_S = 300.0
WINDOW_BUCKETS = 30  # a window slides in steps of window_s / WINDOW_BUCKETS


@dataclass(frozen=True)
class SloTargets:
    """One tenant's targets (``None``: not set, that SLI is not judged)."""

    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    error_rate: float | None = None  # allowed fraction of failed requests, in (0, 1)

    def allowed_bad(self) -> dict[str, float]:
        """Each set SLI's error budget: the fraction of requests allowed to miss it."""
        allowed = {"ttft": self.ttft_p95_s, "itl": self.itl_p95_s}
        out = {sli: 1.0 - LATENCY_QUANTILE for sli, target in allowed.items() if target is not None}
        if self.error_rate is not None:
            out["error"] = self.error_rate
        return out

    def latency_targets(self) -> dict[str, float]:
        """The latency SLIs set, in seconds."""
        targets = {"ttft": self.ttft_p95_s, "itl": self.itl_p95_s}
        return {sli: t for sli, t in targets.items() if t is not None}


NO_SLO = SloTargets()  # a tenant that sets none: only its failures are counted


@dataclass(frozen=True)
class Outcome:
    """What one answered request tells the SLOs."""

    failed: bool
    ttft_s: float | None = None  # None: no token came
    itl_s: float | None = None  # mean gap between its tokens; None: fewer than two


@dataclass
class Tally:
    """Counts of judged requests: all of them, the good and the failed ones, and per SLI those
    judged and those bad."""

    requests: int = 0
    good: int = 0
    failed: int = 0
    judged: dict[str, int] = field(default_factory=dict)  # sli -> requests it was judged on
    bad: dict[str, int] = field(default_factory=dict)  # sli -> requests that missed it

    def add(self, judged: Mapping[str, bool], good: bool, failed: bool) -> None:
        """One request: ``judged`` maps each SLI it was judged on to whether it missed it."""
        self.requests += 1
        self.good += good
        self.failed += failed
        for sli, missed in judged.items():
            self.judged[sli] = self.judged.get(sli, 0) + 1
            self.bad[sli] = self.bad.get(sli, 0) + missed

    def merge(self, other: Tally) -> None:
        self.requests += other.requests
        self.good += other.good
        self.failed += other.failed
        for sli, n in other.judged.items():
            self.judged[sli] = self.judged.get(sli, 0) + n
            self.bad[sli] = self.bad.get(sli, 0) + other.bad.get(sli, 0)

    def bad_fraction(self, sli: str) -> float:
        """Missed over judged (0 when none was judged: no budget spent)."""
        judged = self.judged.get(sli, 0)
        return self.bad.get(sli, 0) / judged if judged else 0.0


def request_outcome(status: int, stream_error: int | None, ttft_s: float | None, itl_s: float | None) -> Outcome | None:
    """What an answered generation request tells its tenant's SLOs (``lorapage serve``'s rule and
    the fleet ingress's): a 5xx, or a started stream's 5xx error event, failed it; a 4xx is the
    client's own and is not judged (None)."""
    if 400 <= status < 500:
        return None
    return Outcome(status >= 500 or (stream_error or 0) >= 500, ttft_s, itl_s)


def judge(outcome: Outcome, targets: SloTargets) -> tuple[dict[str, bool], bool]:
    """Which SLIs ``outcome`` is judged on (sli -> missed), and whether it counts as goodput.
    Latency SLIs judge only requests that measured them; a failed request spends the error budget."""
    judged: dict[str, bool] = {}
    measured = {"ttft": outcome.ttft_s, "itl": outcome.itl_s}
    for sli, target in targets.latency_targets().items():
        value = measured[sli]
        if value is not None:
            judged[sli] = value > target
    if targets.error_rate is not None:
        judged["error"] = outcome.failed
    good = not outcome.failed and not any(missed for sli, missed in judged.items() if sli != "error")
    return judged, good


class SloWindow:
    """One tenant's tallies over the last ``window_s`` seconds, in :data:`WINDOW_BUCKETS` buckets."""

    def __init__(self, window_s: float, buckets: int = WINDOW_BUCKETS) -> None:
        if not window_s > 0 or buckets < 1:
            raise ValueError(f"an SLO window needs window_s > 0 and buckets >= 1, got {window_s!r}, {buckets!r}")
        self.window_s = window_s
        self.bucket_s = window_s / buckets
        self._buckets: dict[int, Tally] = {}  # bucket index (now // bucket_s) -> its tally; at most `buckets`
        self._count = buckets

    def _index(self, now: float) -> int:
        return math.floor(now / self.bucket_s)

    def _prune(self, now: float) -> None:
        oldest = self._index(now) - self._count + 1
        for index in [i for i in self._buckets if i < oldest]:
            del self._buckets[index]

    def add(self, now: float, judged: Mapping[str, bool], good: bool, failed: bool) -> None:
        index = self._index(now)
        tally = self._buckets.get(index)
        if tally is None:  # a new bucket: the oldest may have left the window
            self._prune(now)
            tally = self._buckets[index] = Tally()
        tally.add(judged, good, failed)

    def totals(self, now: float) -> Tally:
        """The window's tally as of ``now`` (requests older than the window are gone)."""
        self._prune(now)
        out = Tally()
        for tally in self._buckets.values():
            out.merge(tally)
        return out


@dataclass(frozen=True)
class TenantSlo:
    """One tenant's SLO figures as of a moment: the window's, and every request's since start."""

    targets: SloTargets
    window: Tally
    lifetime: Tally

    @property
    def goodput_ratio(self) -> float | None:
        """Good over answered in the window (None: none answered)."""
        return self.window.good / self.window.requests if self.window.requests else None

    @property
    def error_ratio(self) -> float | None:
        """Failed over answered in the window (None: none answered)."""
        return self.window.failed / self.window.requests if self.window.requests else None

    def burn_rates(self) -> dict[str, float]:
        """Each set SLI's burn rate over the window: bad fraction over allowed fraction."""
        return {sli: self.window.bad_fraction(sli) / allowed for sli, allowed in self.targets.allowed_bad().items()}


class SloTracker:
    """Every tenant's targets, window and lifetime tallies. Tenants are the tenants file's, so the
    set is bounded; a reload swaps the targets and keeps what was counted."""

    def __init__(self, targets: Mapping[str, SloTargets], window_s: float = DEFAULT_WINDOW_S) -> None:
        self.window_s = window_s
        self._targets = dict(targets)
        self._windows: dict[str, SloWindow] = {}
        self._lifetime: dict[str, Tally] = {}

    def set_targets(self, targets: Mapping[str, SloTargets]) -> None:
        """New targets (a reloaded tenants file); requests already judged stay as judged."""
        self._targets = dict(targets)

    def record(self, tenant: str, outcome: Outcome, now: float) -> None:
        """Judge one answered request of ``tenant`` against its targets at ``now``."""
        judged, good = judge(outcome, self._targets.get(tenant, NO_SLO))
        window = self._windows.get(tenant)
        if window is None:
            window = self._windows[tenant] = SloWindow(self.window_s)
        window.add(now, judged, good, outcome.failed)
        self._lifetime.setdefault(tenant, Tally()).add(judged, good, outcome.failed)

    def report(self, now: float) -> Iterator[tuple[str, TenantSlo]]:
        """Each tenant with targets or requests, sorted by name, as of ``now``."""
        for tenant in sorted(self._targets.keys() | self._windows.keys()):
            window = self._windows.get(tenant)
            yield (
                tenant,
                TenantSlo(
                    self._targets.get(tenant, NO_SLO),
                    window.totals(now) if window is not None else Tally(),
                    self._lifetime.get(tenant, Tally()),
                ),
            )

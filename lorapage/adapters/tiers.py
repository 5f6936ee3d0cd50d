"""Traffic tiers: each adapter version is cold, warm or hot by its hourly traffic (pure, no clock).

Never declared by a customer: inferred from the registry's hourly traffic table
(:class:`~lorapage.registry.store.TrafficRow`) at a time ``now`` (Unix seconds) the caller
passes. The rules (thresholds in :class:`TierRules`, from ``EngineConfig``'s ``tier_*`` fields):

- *requests in the last hour* (and in the last 24 hours) are estimated from hourly rows as a
  sliding window: the hours wholly inside the window count whole, the oldest one in the part of it
  still inside (its requests taken as spread evenly over it): :func:`window_weights`, which the
  registry applies in SQL;
- **hot**: requests in the last hour >= ``hot_requests_per_hour``, or a share of every adapter's
  requests in the last hour >= ``hot_share`` once that total is itself >= ``hot_requests_per_hour``
  (so one request on an idle server is no 100 % share);
- **warm**: not hot, and at least one request in the last 24 hours;
- **cold**: otherwise (and any version without traffic rows).

Hysteresis, so a tier does not flap around a threshold: a hot version stays hot until both its
requests and its share fall below ``hot_exit_ratio`` x the thresholds; and no version is demoted
(hot to warm or cold, warm to cold) before it has held its tier for ``min_hold_s``. Promotions
are immediate. **merged** is reserved for an adapter served by a dedicated deployment of the base
merged with it; these rules never infer it.

What the tiers do is the engine's (:mod:`lorapage.engine.tiering`): hot versions are kept
resident within the pins' bounds, warm ones read into host RAM, cold ones load on demand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorapage.config import EngineConfig

HOUR_S = 3600
DAY_S = 24 * HOUR_S


class Tier(Enum):
    """A version's traffic tier."""

    COLD = "cold"  # no traffic in the last 24 hours: loads on demand
    WARM = "warm"  # some traffic in the last 24 hours: kept in host RAM
    HOT = "hot"  # heavy traffic in the last hour: kept resident in the pool
    MERGED = "merged"  # served by a dedicated deployment with its weights merged: set by the fleet, never inferred here


_RANK = {Tier.COLD: 0, Tier.WARM: 1, Tier.HOT: 2, Tier.MERGED: 3}


@dataclass(frozen=True)
class TierRules:
    """The thresholds of the tier rules (see the module's docstring)."""

    hot_requests_per_hour: float = 120.0
    hot_share: float = 0.1
    hot_exit_ratio: float = 0.5
    min_hold_s: float = 600.0

    @classmethod
    def from_config(cls, config: EngineConfig) -> TierRules:
        """The rules an engine's ``tier_*`` fields set."""
        return cls(
            hot_requests_per_hour=config.tier_hot_requests_per_hour,
            hot_share=config.tier_hot_share,
            hot_exit_ratio=config.tier_hot_exit_ratio,
            min_hold_s=config.tier_min_hold_s,
        )


@dataclass(frozen=True)
class TierState:
    """A version's tier since ``since`` (Unix seconds), with the figures it was last judged on."""

    tier: Tier
    since: float
    last_hour: float = 0.0  # requests in the last hour (sliding estimate)
    share: float = 0.0  # of every adapter's requests in the last hour
    last_day: float = 0.0  # requests in the last 24 hours (sliding estimate)


Recent = tuple[float, float]  # a version's requests in the last hour and in the last 24 hours


def hour_weight(hour: int, now: float, window_s: float) -> float:
    """How much of hour ``hour``'s requests (hours since the epoch) fall in the ``window_s`` before
    ``now``: the part of the hour that has passed which lies in the window (its requests taken as
    spread evenly over it)."""
    start, lo = now - window_s, hour * HOUR_S
    hi = min(lo + HOUR_S, now)  # an hour in progress holds only what has passed of it
    if hi <= lo:
        return 1.0 if start <= lo <= now else 0.0
    return min(1.0, max(0.0, (hi - max(lo, start)) / (hi - lo)))


def window_weights(now: float) -> list[tuple[int, float, float]]:
    """Each hour that counts at ``now``, with its weights in the last hour and in the last 24
    hours: ``(hour, weight in the hour, weight in the day)``, the hour in progress and the 24 before."""
    current = int(now // HOUR_S)
    return [(h, hour_weight(h, now, HOUR_S), hour_weight(h, now, DAY_S)) for h in range(current - 24, current + 1)]


def window_requests(hours: Mapping[int, int], now: float, window_s: float) -> float:
    """Requests in the ``window_s`` before ``now``, from counts per hour (hours since the epoch)."""
    return sum(count * hour_weight(hour, now, window_s) for hour, count in hours.items())


def recent_requests(traffic: Mapping[str, Mapping[int, int]], now: float) -> dict[str, Recent]:
    """Each version's requests in the last hour and the last 24 hours, from version key -> hour ->
    requests (the registry computes the same sums in SQL: ``Registry.weighted_requests``)."""
    return {key: (window_requests(h, now, HOUR_S), window_requests(h, now, DAY_S)) for key, h in traffic.items()}


def _wanted(rules: TierRules, last_hour: float, share: float, total: float, last_day: float, was: Tier) -> Tier:
    """The tier the figures ask for, given the tier held (a hot one leaves at the exit thresholds)."""
    scale = rules.hot_exit_ratio if was is Tier.HOT else 1.0
    floor = rules.hot_requests_per_hour * scale
    if last_hour >= floor or (total >= floor and share >= rules.hot_share * scale):
        return Tier.HOT
    return Tier.WARM if last_day >= 1.0 else Tier.COLD


def assess(
    rules: TierRules, recent: Mapping[str, Recent], previous: Mapping[str, TierState], now: float
) -> dict[str, TierState]:
    """Every version's tier at ``now`` (Unix seconds) from its ``recent`` requests (last hour,
    last 24 hours; :func:`recent_requests`) and the tiers held before (``previous``). Versions
    that come out cold are left out: absent means cold."""
    total = sum(hour for hour, _ in recent.values())
    out: dict[str, TierState] = {}
    for key in recent.keys() | previous.keys():
        prev = previous.get(key)
        was = prev.tier if prev is not None else Tier.COLD
        hour, day = recent.get(key, (0.0, 0.0))
        share = hour / total if total else 0.0
        tier = _wanted(rules, hour, share, total, day, was)
        if prev is not None and _RANK[tier] < _RANK[was] and now - prev.since < rules.min_hold_s:
            tier = was  # held too briefly to be demoted
        if tier is Tier.COLD:
            continue  # absent: cold (a promotion out of cold is immediate, so when it began does not matter)
        since = prev.since if prev is not None and prev.tier is tier else now
        out[key] = TierState(tier, since, last_hour=hour, share=share, last_day=day)
    return out


def ranked(states: Mapping[str, TierState], tier: Tier) -> list[str]:
    """The versions in ``tier``, most requested first (last hour for hot, last day otherwise)."""
    keys = [k for k, s in states.items() if s.tier is tier]
    if tier is Tier.HOT:
        return sorted(keys, key=lambda k: (-states[k].last_hour, k))
    return sorted(keys, key=lambda k: (-states[k].last_day, k))

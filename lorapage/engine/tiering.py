"""The traffic table and the traffic tiers, kept on the engine's event loop without blocking it.

Requests and tokens are counted where cost is attributed (the usage ledger, per step, in memory:
:meth:`~lorapage.usage.ledger.UsageLedger.take_traffic`). Every ``tier_interval_s`` the
:class:`TierKeeper` takes those counts and, in one call on an I/O thread, adds them to the
registry's hourly traffic table (pruning hours past the retention: :class:`TrafficStore`), has
SQLite sum each version's
requests of the last hour and the last 24 hours (one row per version, weighted by
:func:`~lorapage.adapters.tiers.window_weights`) and judges every version's tier
(:func:`~lorapage.adapters.tiers.assess`: pure, given the time).
Back on the loop it only carries the result out (:meth:`TierKeeper.apply`): hot versions kept
resident, warm ones read into host RAM (:meth:`~lorapage.adapters.cache.AdapterCache.set_hot`,
``prewarm``). The tiers are read from the table, so they survive a restart; a write that fails
gives its counts back to the ledger for the next one.

In a fleet the same keeper runs twice (:mod:`lorapage.fleet.traffic`): at the ingress, over the
fleet's registry and the counts every replica reports (it judges, and carries nothing out), and
in each replica's engine, which *follows* (:meth:`TierKeeper.follow`): its counts leave with its
heartbeats, and it carries out the tiers the ingress judged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Protocol

from lorapage.adapters.names import parse_name
from lorapage.adapters.tiers import HOUR_S, Tier, TierRules, TierState, assess, ranked, window_weights
from lorapage.registry.store import TrafficRow
from lorapage.usage.ledger import Traffic, TrafficKey

TIER_WINDOW_HOURS = 25  # the last 24 hours, and the hour in progress

log = logging.getLogger("lorapage.engine")


def traffic_rows(taken: Mapping[TrafficKey, Traffic]) -> list[TrafficRow]:
    """The ledger's counts as rows to add to the traffic table."""
    rows = []
    for (hour, key), t in taken.items():
        adapter_id, version = parse_name(key)
        if version is not None and version > 0:
            rows.append(TrafficRow(adapter_id, version, hour, t.requests, t.prompt_tokens, t.output_tokens))
    return rows


class TrafficStore(Protocol):
    """Where the traffic table is kept: :class:`~lorapage.registry.traffic.RegistryTraffic` over an
    engine's registry (or a fleet's). Blocking calls (the tier keeper makes them on an I/O thread)."""

    def keep_traffic(
        self, rows: list[TrafficRow], hour: int, retention_hours: int, *, audit_before: float | None = None
    ) -> None: ...

    def requests_by_version(self, weights: Sequence[tuple[int, float, float]]) -> dict[str, tuple[float, float]]: ...

    def traffic_rows(self, since_hour: int, adapter_id: str | None = None) -> list[TrafficRow]: ...


class TrafficCounts(Protocol):
    """Where counts wait to be written: an engine's :class:`~lorapage.usage.ledger.UsageLedger`,
    or the fleet's ingress's inbox of the replicas' reports."""

    traffic: dict[TrafficKey, Traffic]  # counted since the last take

    def take_traffic(self) -> dict[TrafficKey, Traffic]: ...

    def restore_traffic(self, taken: Mapping[TrafficKey, Traffic]) -> None: ...


class TierTarget(Protocol):
    """What carries the tiers out: an engine's :class:`~lorapage.adapters.cache.AdapterCache`."""

    @property
    def entries(self) -> Mapping[str, object]: ...  # the versions it knows, by key

    def set_hot(self, names: list[str]) -> None: ...

    def prewarm(self, names: list[str]) -> None: ...


class TierKeeper:
    """Writes the batched traffic counts and keeps every version's traffic tier (``states``)."""

    def __init__(
        self,
        rules: TierRules,
        usage: TrafficCounts,
        store: TrafficStore,
        adapters: TierTarget | None,
        executor: Executor,
        wall_clock: Callable[[], float],
        *,
        interval_s: float,
        retention_hours: int,
        audit_retention_s: float = 0.0,
    ) -> None:
        """``wall_clock``: Unix seconds (the engine's clock plus the ledger's offset); ``adapters``
        None: the tiers are judged here and carried out elsewhere (the fleet's ingress)."""
        self.rules, self.usage, self.store, self.adapters = rules, usage, store, adapters
        self.executor, self.wall_clock = executor, wall_clock
        self.interval_s, self.retention_hours = interval_s, retention_hours
        self.audit_retention_s = audit_retention_s  # 0: the audit trail is kept whole
        self.states: dict[str, TierState] = {}  # version key -> its tier; absent: cold
        self.judged = 0  # judgements made here (a follower counts those it was sent)
        self.leads = True  # False: another keeper judges (follow)
        self._task: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None

    def tier(self, key: str) -> Tier:
        """Version ``key``'s traffic tier at the last evaluation (cold before the first)."""
        state = self.states.get(key)
        return state.tier if state is not None else Tier.COLD

    def follow(self) -> None:
        """Judge no more here: the counts are taken by whoever reports them (a fleet replica's
        heartbeat) and the tiers come back through :meth:`apply`."""
        self.leads = False
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def start(self) -> None:
        """Re-evaluate every ``interval_s`` on the running loop (a task of a loop that ended is
        gone); nothing while following."""
        if not self.leads:
            return
        if self._task is not None and not self._task.done() and self._task.get_loop() is asyncio.get_running_loop():
            return  # already running here
        self._lock = asyncio.Lock()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lorapage-tiers")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # a registry that cannot be written must not end the re-evaluations
                log.exception("traffic tiers: writing the traffic table failed; retrying next time")

    async def refresh(self) -> dict[str, TierState]:
        """Write the counts taken since the last time, judge the tiers now and carry them out."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one at a time: each judges from the tiers the previous one left
            taken = self.usage.take_traffic()
            now = self.wall_clock()
            loop = asyncio.get_running_loop()
            try:
                states = await loop.run_in_executor(
                    self.executor, self._write_and_assess, traffic_rows(taken), now, dict(self.states)
                )
            except Exception:  # not committed (one transaction): the next write takes the counts
                self.usage.restore_traffic(taken)
                raise
            self.judged += 1
            self.apply(states)
            return states

    def apply(self, states: dict[str, TierState]) -> None:
        """Hold ``states`` as the tiers and carry them out: hot versions kept resident, warm ones
        read into host RAM (a follower's tiers, judged by the keeper it follows)."""
        self.states = states
        if self.adapters is None:
            return
        known = self.adapters.entries
        self.adapters.set_hot([k for k in ranked(states, Tier.HOT) if k in known])
        self.adapters.prewarm([k for k in ranked(states, Tier.WARM) if k in known])

    def _write_and_assess(
        self, rows: list[TrafficRow], now: float, previous: dict[str, TierState]
    ) -> dict[str, TierState]:
        """On an I/O thread: add ``rows``, sum the recent hours per version, judge the tiers."""
        audit_before = now - self.audit_retention_s if self.audit_retention_s > 0 else None
        self.store.keep_traffic(rows, int(now // HOUR_S), self.retention_hours, audit_before=audit_before)
        return assess(self.rules, self.store.requests_by_version(window_weights(now)), previous, now)

    async def stop(self) -> None:
        """Stop re-evaluating and write the counts not written yet (before the catalog closes)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, RuntimeError):  # RuntimeError: its loop is gone
                pass
            self._task = None
        rows = traffic_rows(self.usage.take_traffic())
        if rows:
            hour = int(self.wall_clock() // HOUR_S)
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self.store.keep_traffic, rows, hour, self.retention_hours
            )

    async def recent(self, adapter_id: str, hours: int = TIER_WINDOW_HOURS) -> list[TrafficRow]:
        """``adapter_id``'s versions' rows of the last ``hours`` hours (the hour in progress
        included), with the counts not written yet added in."""
        hour = int(self.wall_clock() // HOUR_S)
        since = hour - hours + 1
        stored = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.store.traffic_rows, since, adapter_id
        )
        merged = {(r.adapter_id, r.version, r.hour): r for r in stored}
        for r in traffic_rows(self.usage.traffic):
            if r.adapter_id != adapter_id or r.hour < since:
                continue
            had = merged.get((r.adapter_id, r.version, r.hour))
            if had is not None:
                r = TrafficRow(
                    r.adapter_id,
                    r.version,
                    r.hour,
                    had.requests + r.requests,
                    had.prompt_tokens + r.prompt_tokens,
                    had.output_tokens + r.output_tokens,
                )
            merged[(r.adapter_id, r.version, r.hour)] = r
        return sorted(merged.values(), key=lambda r: (r.version, r.hour))

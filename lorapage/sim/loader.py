"""The simulator's loader: one replica's adapters under the engine's own residency rules, on a virtual clock.

The rules are :class:`~lorapage.adapters.residency.Residency`, the very object the engine's
adapter cache drives; this carries its decisions out in virtual time instead of with threads
and a device (``docs/fleet.md``):

- a read (:class:`~lorapage.adapters.residency.Read`) takes the seconds of the tier it starts
  from (:class:`~lorapage.sim.costs.LoadCosts`: host RAM none, disk ``disk_s``, remote
  ``remote_s + disk_s``) off the device, and lands the adapter on the local disk, an LRU of
  ``max_disk_loras`` (None: every adapter is on disk; an adapter that falls off it is remote);
- a copy into the pool (:class:`~lorapage.adapters.residency.Load`) is done at once and its
  ``copy_s`` device seconds are charged to the next step;
- a prefetch reads from disk in ``disk_s`` (off by default: ``max_prefetches`` 0).

Not modelled: KV pages and adapter pages share one pool in the engine; here adapters take their
pages from a pool of their own, large enough that the lora slots are the only limit, and KV
pages are the simulator's separate count. Every adapter of a trace registers on its first
request, with ``pages`` of its own (default: its rank).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from lorapage.adapters.decisions import Decision, Load, Prefetch, Read
from lorapage.adapters.residency import GPU, RAM, Residency, ResidencyLimits
from lorapage.adapters.value import LoadTier
from lorapage.memory.pages import PageAllocator
from lorapage.memory.reclaim import Reclaim
from lorapage.sim.costs import LoadCosts

TIERS = (GPU, RAM, LoadTier.DISK.value, LoadTier.REMOTE.value)


@dataclass(frozen=True)
class ResidencyConfig:
    """Capacities of one replica's tiers (vLLM names where the engine has them)."""

    max_resident_loras: int = 32  # lora slots (the batch's distinct adapters are the policy's max_loras)
    max_cpu_loras: int = 128  # adapters in host RAM
    max_disk_loras: int | None = None  # adapters in the local disk cache; None: every adapter is on disk
    adapter_wait_s: float = 1.0
    rank: int = 16  # rank of every adapter (traces carry none)
    # Pages an adapter takes, by name (default: its rank): eviction weighs request rate per page.
    pages: Mapping[str, int] = field(default_factory=dict)
    max_prefetches: int = 0  # prefetches into host RAM at once (the engine's: min(2, io_threads - 1))


class SimReloadCosts:
    """What bringing an adapter back costs, per page (as the engine's measured
    :class:`~lorapage.adapters.value.ReloadCosts`), from the cost model's seconds for an adapter
    of ``rank`` taking ``rank`` pages."""

    def __init__(self, loads: LoadCosts, rank: int) -> None:
        self._fetch_s = {LoadTier.RAM: 0.0, LoadTier.DISK: loads.disk_s, LoadTier.REMOTE: loads.remote_s + loads.disk_s}
        self._copy_s, self._pages = loads.copy_s, max(rank, 1)

    def fetch_s(self, tier: LoadTier) -> float:
        """Seconds a read from ``tier`` into host RAM takes."""
        return self._fetch_s[tier]

    def reload_s(self, tier: LoadTier, pages: int) -> float:
        return pages * (self._fetch_s[tier] + self._copy_s) / self._pages


class SimLoader:
    """One replica's adapter tiers: the residency rules, and their reads and copies in virtual time."""

    def __init__(self, config: ResidencyConfig, loads: LoadCosts, disk: frozenset[str] = frozenset()) -> None:
        self.config = config
        self.loads = loads.scaled(config.rank)
        self.costs = SimReloadCosts(self.loads, config.rank)
        most = max([config.rank, *config.pages.values()])
        self.pool = PageAllocator(1 + config.max_resident_loras * most)  # the slots bind first
        limits = ResidencyLimits(
            config.max_resident_loras,
            config.max_cpu_loras,
            config.adapter_wait_s,
            max_prefetches=config.max_prefetches,
        )
        self.rules = Residency(limits, self.pool, Reclaim(self.pool), self.costs)
        self.disk: OrderedDict[str, None] = OrderedDict((a, None) for a in sorted(disk))
        self._due: list[tuple[float, str, str]] = []  # heap of (when, key, "read" | "prefetch") in flight
        self._copy_s = 0.0  # copies decided since the last advance
        self._version = 0  # bumped when a tier's membership may have changed
        self._snapshot: tuple[int, tuple[frozenset[str], frozenset[str], frozenset[str]]] | None = None

    @property
    def version(self) -> int:
        """Bumped whenever an adapter may have changed tier (a router's view of it may be stale)."""
        return self._version

    def tier(self, name: str) -> str:
        return self.rules.tier(name) if name in self.rules.adapters else self._cold(name).value

    def snapshot(self) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """Adapters in the pool, host RAM and the disk cache (empty when the disk holds every
        adapter: then it tells a router nothing), as a replica reports them."""
        if self._snapshot is None or self._snapshot[0] != self._version:
            disk = frozenset(self.disk) if self.config.max_disk_loras is not None else frozenset()
            host = frozenset(self.rules.host.keys())
            self._snapshot = (self._version, (frozenset(self.rules.slots.resident()), host, disk))
        return self._snapshot[1]

    # -- what the simulator tells it (the engine's adapter cache role) ----------------------------

    def arrive(self, name: str, now: float, tenant: str | None = None) -> str:
        """A request for ``name`` arrived: its tier now; its load starts if it is not resident."""
        if name not in self.rules.adapters:
            self.rules.add(name, self.config.pages.get(name, self.config.rank), self._cold(name))
        tier = self.rules.tier(name)
        self._apply(self.rules.enqueue(name, now, tenant), now)
        return tier

    def ready(self, name: str) -> bool:
        return self.rules.is_ready(name)

    def prewarm(self, name: str, now: float) -> None:
        """Load ``name`` into the pool ahead of its requests (what ``Engine.load_adapter`` does on
        a fleet replica): its read starts now from whichever tier it is in."""
        if name not in self.rules.adapters:
            self.rules.add(name, self.config.pages.get(name, self.config.rank), self._cold(name))
        self._apply(self.rules.ensure(name), now)

    def admit(self, name: str, now: float) -> None:
        self.rules.admit(name, now)

    def finish(self, name: str, now: float) -> None:
        self.rules.finish(name)

    def requeue(self, name: str, now: float) -> None:
        self.rules.requeue(name)

    def advance(self, now: float) -> float:
        """Complete what is due by ``now`` (reads land, loads take slots, evicting or making
        adapters yield as the rules say); the device seconds of the copies into the pool."""
        while self._due and self._due[0][0] <= now:
            _, key, kind = heapq.heappop(self._due)
            self._touch_disk(key)
            if kind == "read":
                self._apply(self.rules.read_done(key, now), now)
            else:
                self._apply(self.rules.prefetch_done(key, True), now)
        self._apply(self.rules.tick(now), now)
        copy_s, self._copy_s = self._copy_s, 0.0
        return copy_s

    def next_event(self, now: float) -> float | None:
        """The next time a load may progress without a step happening first (None: no such time)."""
        times = [t for t, *_ in self._due if t > now]
        check = self.rules.loads.next_check(now)
        if check is not None:
            times.append(check)
        return min(times) if times else None

    def settled_until(self, now: float) -> float:
        """Until when :meth:`advance` has nothing to do: ``now`` while a load is under way (it may
        be placed at any step), else the next prefetch due (``math.inf``: none)."""
        if self.rules.loads.loading():
            return now
        return min((t for t, *_ in self._due), default=math.inf)

    # -- carrying out the rules' decisions ----------------------------------------------------------

    def _apply(self, decisions: list[Decision], now: float) -> None:
        if decisions:
            self._version += 1
        for d in decisions:
            if isinstance(d, Read):
                heapq.heappush(self._due, (now + self.costs.fetch_s(d.tier), d.key, "read"))
            elif isinstance(d, Prefetch):
                heapq.heappush(self._due, (now + self.costs.fetch_s(LoadTier.DISK), d.key, "prefetch"))
            elif isinstance(d, Load):
                self._copy_s += self.loads.copy_s
                self._apply(self.rules.copy_done(d.key, d.slot, True, now), now)
            # Evict, Release, DropHost, Yield, Ready, Cancel: nothing to carry out here.

    def _cold(self, name: str) -> LoadTier:
        on_disk = self.config.max_disk_loras is None or name in self.disk
        return LoadTier.DISK if on_disk else LoadTier.REMOTE

    def _touch_disk(self, name: str) -> None:
        """``name`` was read: it is on the local disk now, the most recently used there."""
        self.disk[name] = None
        self.disk.move_to_end(name)
        self._version += 1
        bound = self.config.max_disk_loras
        while bound is not None and len(self.disk) > bound:
            gone, _ = self.disk.popitem(last=False)
            if gone in self.rules.adapters:
                self.rules.set_cold(gone, LoadTier.REMOTE)
        if name in self.rules.adapters:
            self.rules.set_cold(name, LoadTier.DISK)

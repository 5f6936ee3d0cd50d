"""Where a simulated replica's adapters are: pool slots, host RAM, local disk, the object store.

The real :class:`~lorapage.adapters.cache.AdapterCache` cannot run here: its loads are asyncio
tasks over I/O threads and the forward thread, and it copies real tensors into a real pool. This
is an explicit model of the same rules on the virtual clock (``docs/fleet.md``):

- tier at arrival: ``gpu`` (resident in a lora slot), ``ram`` (host copy), ``disk`` (local disk),
  ``remote`` (object store; the real engine has no such tier for files under its adapter root);
- a request's arrival counts it as waiting, bumps the adapter's decayed request rate (half-life
  :data:`RATE_HALF_LIFE_S`, as the cache) and starts the load at once, so fetching overlaps
  queueing; the fetch (remote -> disk -> host) runs off the device;
- host RAM is an LRU of ``max_cpu_loras``, the disk cache an LRU of ``max_disk_loras``;
- a fetched adapter takes a free lora slot, else the idle (nothing running or waiting) resident
  adapter with the least rate per page is evicted; the host -> pool copy costs device time,
  charged to the next step;
- a load that found every slot busy for ``adapter_wait_s`` while requests wait joins the line of
  starving loads; the first in line makes the least valuable busy adapter yield (it admits
  nothing new and gives up its slot once its running requests finish).

Not modelled: KV pages and adapter pages share one pool in the engine; here slots are the only
limit on adapters (the seed sizes the GPU cache as a fixed share of memory), and KV pages are the
simulator's separate count.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from lorapage.memory.reclaim import value_per_page
from lorapage.sim.costs import LoadCosts

RATE_HALF_LIFE_S = 60.0  # as lorapage.adapters.cache.RATE_HALF_LIFE_S (not imported: that pulls torch)
GPU, RAM, DISK, REMOTE = "gpu", "ram", "disk", "remote"
TIERS = (GPU, RAM, DISK, REMOTE)


@dataclass(frozen=True)
class ResidencyConfig:
    """Capacities of one replica's tiers (vLLM names where the engine has them)."""

    max_loras: int = 32  # lora slots
    max_cpu_loras: int = 128  # adapters in host RAM
    max_disk_loras: int | None = None  # adapters in the local disk cache; None: every adapter is on disk
    adapter_wait_s: float = 1.0
    rank: int = 16  # rank of every adapter (traces carry none)
    # Pages an adapter takes, by name (default: its rank): eviction weighs request rate per page.
    pages: Mapping[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class _Adapter:
    name: str
    pages: int
    slot: bool = False  # resident in a lora slot
    running: int = 0
    waiting: int = 0
    rate: float = 0.0
    rate_time: float = 0.0
    yielding: bool = False
    fetch_done: float | None = None  # a load in flight: when its fetch into host RAM completes
    slot_wait_since: float | None = None  # fetched, waiting for a slot since

    def rate_at(self, now: float) -> float:
        return self.rate * math.exp2(-(now - self.rate_time) / RATE_HALF_LIFE_S)


@dataclass
class ResidencyCounters:
    """What happened to arrivals and loads (arrivals by tier at the moment they arrived)."""

    arrivals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    loads: int = 0
    evictions: int = 0
    yields: int = 0


class AdapterResidency:
    """One replica's adapter tiers under the cache's rules, on a virtual clock."""

    def __init__(self, config: ResidencyConfig, loads: LoadCosts, disk: frozenset[str] = frozenset()) -> None:
        self.config = config
        self.loads = loads.scaled(config.rank)
        self.adapters: dict[str, _Adapter] = {}
        self.host: OrderedDict[str, None] = OrderedDict()
        self.disk: OrderedDict[str, None] = OrderedDict((a, None) for a in sorted(disk))
        self.free_slots = config.max_loras
        self.resident: dict[str, _Adapter] = {}  # in a lora slot
        self.loading: dict[str, _Adapter] = {}  # fetching, or fetched and waiting for a slot
        self.starving: list[_Adapter] = []
        self.counters = ResidencyCounters()
        self._version = 0  # bumped when a tier's membership may have changed
        self._snapshot: tuple[int, tuple[frozenset[str], frozenset[str], frozenset[str]]] | None = None

    def _get(self, name: str) -> _Adapter:
        entry = self.adapters.get(name)
        if entry is None:
            entry = self.adapters[name] = _Adapter(name, pages=self.config.pages.get(name, self.config.rank))
        return entry

    def tier(self, name: str) -> str:
        entry = self.adapters.get(name)
        if entry is not None and entry.slot:
            return GPU
        if name in self.host:
            return RAM
        if self.config.max_disk_loras is None or name in self.disk:
            return DISK
        return REMOTE

    def snapshot(self) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """Adapters in the pool, host RAM and the disk cache (empty when the disk holds every
        adapter: then it tells a router nothing), as a replica reports them."""
        if self._snapshot is None or self._snapshot[0] != self._version:
            disk = frozenset(self.disk) if self.config.max_disk_loras is not None else frozenset()
            self._snapshot = (self._version, (frozenset(self.resident), frozenset(self.host), disk))
        return self._snapshot[1]

    # -- what the simulator tells it --------------------------------------------------------------

    def arrive(self, name: str, now: float) -> str:
        """A request for ``name`` arrived: its tier now; the load starts if it is not resident."""
        tier = self.tier(name)
        self.counters.arrivals[tier] += 1
        entry = self._get(name)
        entry.waiting += 1
        entry.rate = entry.rate_at(now) + 1.0
        entry.rate_time = now
        self._ensure(entry, now)
        return tier

    def ready(self, name: str) -> bool:
        entry = self.adapters[name]
        return entry.slot and not entry.yielding

    def pin(self, name: str) -> None:
        entry = self.adapters[name]
        entry.running += 1
        entry.waiting -= 1

    def unpin(self, name: str, now: float) -> None:
        self.adapters[name].running -= 1

    def requeue(self, name: str, now: float) -> None:
        entry = self.adapters[name]
        entry.running -= 1
        entry.waiting += 1

    def advance(self, now: float) -> float:
        """Complete what is due by ``now``: fetched loads take slots (evicting or making adapters
        yield as the cache would). Returns the device seconds of the copies into the pool."""
        copy_s = 0.0
        if not self.loading:
            return 0.0
        due = [e for e in self.loading.values() if e.fetch_done is not None and e.fetch_done <= now]
        for entry in sorted(due, key=lambda e: (e.fetch_done, e.name)):
            self._fetched(entry, now)
        fetched = [e for e in self.loading.values() if e.slot_wait_since is not None]
        for entry in sorted(fetched, key=lambda e: (e.slot_wait_since, e.name)):
            if self._take_slot(entry, now):
                copy_s += self.loads.copy_s
        return copy_s

    def next_event(self, now: float) -> float | None:
        """The next time a load may progress without a step happening first (None: no such time)."""
        times = []
        for entry in self.loading.values():
            if entry.fetch_done is not None:
                times.append(entry.fetch_done)
            elif entry.slot_wait_since is not None and entry not in self.starving:
                times.append(entry.slot_wait_since + self.config.adapter_wait_s)
        later = [t for t in times if t > now]
        return min(later) if later else None

    # -- internals --------------------------------------------------------------------------------

    def _ensure(self, entry: _Adapter, now: float) -> None:
        if entry.slot or entry.fetch_done is not None or entry.slot_wait_since is not None:
            return
        self.counters.loads += 1
        tier = self.tier(entry.name)
        fetch = {RAM: 0.0, DISK: self.loads.disk_s, REMOTE: self.loads.remote_s + self.loads.disk_s}[tier]
        entry.fetch_done = now + fetch
        self.loading[entry.name] = entry

    def _value(self, entry: _Adapter, now: float) -> float:
        """The engine's value per page (:func:`lorapage.adapters.value.value_per_page`): recent
        rate x the cost of reloading from the tier it would fall to (host RAM, disk, remote)."""
        in_disk = self.config.max_disk_loras is None or entry.name in self.disk
        falls_to = RAM if entry.name in self.host else DISK if in_disk else REMOTE
        fetch = {RAM: 0.0, DISK: self.loads.disk_s, REMOTE: self.loads.remote_s + self.loads.disk_s}[falls_to]
        return value_per_page(entry.rate_at(now), fetch + self.loads.copy_s, entry.pages)

    def _fetched(self, entry: _Adapter, now: float) -> None:
        entry.fetch_done = None
        entry.slot_wait_since = now
        self._version += 1
        _touch(self.disk, entry.name, self.config.max_disk_loras)
        _touch(self.host, entry.name, self.config.max_cpu_loras)

    def _take_slot(self, entry: _Adapter, now: float) -> bool:
        if not self.free_slots:
            idle = [e for e in self.resident.values() if e.running == 0 and e.waiting == 0]
            if idle:
                self._evict(min(idle, key=lambda e: (self._value(e, now), e.name)), now)
            else:
                self._maybe_yield(entry, now)
        if not self.free_slots:
            return False
        self.free_slots -= 1
        entry.slot, entry.slot_wait_since = True, None
        self.resident[entry.name] = entry
        del self.loading[entry.name]
        self._version += 1
        if entry in self.starving:
            self.starving.remove(entry)
        return True

    def _maybe_yield(self, entry: _Adapter, now: float) -> None:
        assert entry.slot_wait_since is not None
        yielding = [e for e in self.resident.values() if e.yielding]
        done = [e for e in yielding if e.running == 0]
        for e in done:
            self._evict(e, now)
        if done or now - entry.slot_wait_since < self.config.adapter_wait_s or not entry.waiting:
            return
        if entry not in self.starving:
            self.starving.append(entry)
        if self.starving[0] is entry and not yielding:
            busy = [e for e in self.resident.values() if not e.yielding]
            if busy:
                victim = min(busy, key=lambda e: (self._value(e, now), e.name))
                victim.yielding = True
                self.counters.yields += 1
                if victim.running == 0:
                    self._evict(victim, now)

    def _evict(self, entry: _Adapter, now: float) -> None:
        entry.slot, entry.yielding = False, False
        del self.resident[entry.name]
        self._version += 1
        self.free_slots += 1
        self.counters.evictions += 1
        if entry.waiting:  # queued requests still need it: reload (from host RAM, usually)
            self._ensure(entry, now)


def _touch(lru: OrderedDict[str, None], name: str, bound: int | None) -> None:
    lru[name] = None
    lru.move_to_end(name)
    while bound is not None and len(lru) > bound:
        lru.popitem(last=False)

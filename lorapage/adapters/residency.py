"""Where each adapter version lives and what leaves: every residency rule, without torch or a clock.

A version is in one of four tiers: the pool (one of ``max_resident_loras`` lora slots and its
pages), host RAM (its packed copy, an LRU bounded by ``max_cpu_loras`` copies and, when given,
``max_cpu_lora_bytes`` bytes), the local disk, or remote (a source not in the disk cache). How many
distinct adapters one batch holds (``max_loras``) is the scheduler's rule, not this module's.
:class:`Residency` holds the rules that move it between them:

- a request's arrival (:meth:`Residency.enqueue`) counts it as waiting, bumps the version's
  decayed request rate and starts its load, so fetching overlaps queueing; it also queues a
  prefetch of the tenant's other recent versions into host RAM (:mod:`lorapage.adapters.prefetch`);
- a load reads into host RAM, then waits for a lora slot and its pages: a free slot, else the
  idle resident version (nothing running or waiting, not pinned) of least value per page leaves;
  pages come free, else idle cached KV blocks and idle versions leave in one ranking
  (:class:`~lorapage.memory.reclaim.Reclaim`);
- a load that requests (or an admin pin) wait for, finding every slot busy for
  ``adapter_wait_s``, joins the line of starving loads; the first in line makes the busy version
  of least value per page *yield* (it admits nothing new and leaves once its running requests end
  and its pages complete the room), sparing any resident for less than ``adapter_wait_s``;
- admin pins hold a version resident, bounded by :class:`~lorapage.adapters.pins.PinBounds`;
- the traffic tiers (:mod:`lorapage.adapters.tiers`) hold their *hot* versions resident as pins
  do (:meth:`Residency.set_hot`), most requested first, only within the same bounds counted with
  the admin pins, and never ahead of one: an admin pin that needs their room takes it (the least
  requested hot version is let go first). *Warm* versions are read into host RAM ahead of their
  requests (:meth:`Residency.prewarm`), as prefetches under the tiers' own share;
- KV admission keeps :meth:`Residency.pending_pages` free for the largest load waiting on memory.

The rules take the time as an argument and answer with *decisions*
(:mod:`lorapage.adapters.decisions`): what to read, prefetch, copy into which slot and pages,
evict, drop from host RAM. Whoever drives them
carries the decisions out and reports back when a read or a copy is done: the engine's
:class:`~lorapage.adapters.cache.AdapterCache` with I/O threads and the device, the simulator's
:class:`~lorapage.sim.loader.SimLoader` on a virtual clock. So a rule is written once, here.

Every event that decided something is kept in :attr:`Residency.history` (bounded) with its
decisions: the engine and the simulator can be compared decision by decision.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from lorapage.adapters.decisions import (
    Cancel,
    Decision,
    DropHost,
    Evict,
    Load,
    Prefetch,
    Read,
    Ready,
    Release,
    Yield,
)
from lorapage.adapters.pins import PinBounds
from lorapage.adapters.prefetch import PREFETCH_QUEUE_LEN, PrefetchQueue
from lorapage.adapters.value import LoadTier, RecentAdapters
from lorapage.errors import AdapterBusyError, AdapterNotFoundError, ConflictError
from lorapage.memory.pages import PageKind
from lorapage.memory.reclaim import RATE_HALF_LIFE_S, Reclaim, value_per_page

GPU, RAM = "gpu", "ram"  # tiers above the cold ones (LoadTier.DISK, LoadTier.REMOTE)
TIERS_TENANT = "(traffic tiers)"  # whose share the warm versions' prefetches take (no tenant is named so)
EVICTION_WINDOW_S = 60.0  # evictions are remembered this long (for evictions per minute)
HISTORY_LEN = 512  # events kept with their decisions


# -- state ----------------------------------------------------------------------------------------


class Phase(Enum):
    """Where a version's load stands."""

    COLD = "cold"  # not in the pool, no load
    READING = "reading"  # a load is bringing its packed copy into host RAM
    PLACING = "placing"  # its packed copy is in hand: waiting for a lora slot and pages
    COPYING = "copying"  # slot and pages reserved, its copy into them in flight
    RESIDENT = "resident"  # in the pool


class LoadWait(Enum):
    """What a load that found no room waits for."""

    ROOM = "room"  # a lora slot is free but pages are short: until pages free
    YIELDED = "yielded"  # a busy adapter yields its slot to this load: until it is idle
    PATIENT = "patient"  # every slot busy for less than adapter_wait_s: until one frees, or adapter_wait_s
    STARVING = "starving"  # every slot busy for adapter_wait_s, requests wait: in line to make one yield
    PREWARM = "prewarm"  # every slot busy and no request waits (a pre-warm): until a slot frees


@dataclass(eq=False)
class Residence:
    """One registered version: where it is, who uses it, and how its load stands."""

    key: str
    pages: int  # pool pages it takes when resident
    host_bytes: int = 0  # bytes its packed copy takes in host RAM
    cold: LoadTier = LoadTier.DISK  # where it comes from when not in host RAM: DISK or REMOTE
    phase: Phase = Phase.COLD
    slot: int = 0  # its lora slot while COPYING or RESIDENT
    page_ids: list[int] = field(default_factory=list)  # its pool pages while COPYING or RESIDENT
    running: int = 0  # admitted requests using it: never evicted while > 0
    waiting: int = 0  # queued requests for it
    rate: float = 0.0  # exponentially decayed request count
    rate_time: float = 0.0
    yielding: bool = False  # admits nothing new: a starving load takes its lora slot once it is idle
    pinned: bool = False  # an admin pinned it: never evicted, never made to yield
    hot: bool = False  # its traffic tier is hot and it fits the pins' bounds: kept as a pin is (set_hot)
    resident_since: float = 0.0  # when it last became resident (it yields only after adapter_wait_s)
    # The load in flight, if any.
    load_tier: LoadTier | None = None  # where it started (what its metrics say)
    downloading: bool = False  # READING from a remote source, not at the files yet: reads no files
    joined: bool = False  # READING through the prefetch of it in flight
    since: float = 0.0  # PLACING: when it began waiting for room
    order: int = 0  # PLACING: among loads that began waiting at one time
    yielded: Residence | None = None  # PLACING: the busy version yielding its slot to this load

    def touch(self, now: float) -> None:
        self.rate = self.rate_at(now) + 1.0
        self.rate_time = now

    def rate_at(self, now: float) -> float:
        return self.rate * math.exp2(-(now - self.rate_time) / RATE_HALF_LIFE_S)


@dataclass(frozen=True)
class ResidencyLimits:
    """The sizes and times the rules work within (vLLM names where the engine has them)."""

    max_resident_loras: int  # lora slots: versions resident in the pool at once
    max_cpu_loras: int  # packed copies in host RAM
    adapter_wait_s: float = 1.0  # a load finding every slot busy this long may make one yield
    max_prefetches: int = 0  # prefetches into host RAM running at once (0: none)
    pins: PinBounds | None = None  # None: pins refused (no bounds given)
    max_cpu_lora_bytes: int | None = None  # bytes of the packed copies in host RAM together; None: no bound


class AdapterPages(Protocol):
    """The pool's allocator, as far as adapters use it (:class:`~lorapage.memory.pages.PageAllocator`)."""

    @property
    def num_free(self) -> int: ...

    @property
    def used(self) -> dict[PageKind, int]: ...

    def allocate(self, n: int, kind: PageKind) -> list[int] | None: ...

    def free(self, pages: list[int], kind: PageKind) -> None: ...


class ReloadCost(Protocol):
    """Seconds to bring a version back into the pool (:class:`~lorapage.adapters.value.ReloadCosts`)."""

    def reload_s(self, tier: LoadTier, pages: int) -> float: ...


HistoryEntry = tuple[str, str, tuple[Decision, ...]]  # (event, the key it was about or "", decisions)


class Residency:
    """Every version's tier, its load, its requests and its pins, under the rules of this module."""

    def __init__(self, limits: ResidencyLimits, pages: AdapterPages, reclaim: Reclaim, costs: ReloadCost) -> None:
        self.limits, self.pages, self.reclaimer, self.costs = limits, pages, reclaim, costs
        self.adapters: dict[str, Residence] = {}
        self._free_slots = list(range(limits.max_resident_loras, 0, -1))  # popped from the end: the last freed first
        self._by_slot: dict[int, Residence] = {}  # resident versions
        self._host: OrderedDict[str, int] = OrderedDict()  # version -> bytes of its packed copy in host RAM, LRU first
        self._host_bytes = 0  # their sum
        self._loads: dict[str, Residence] = {}  # READING, PLACING or COPYING
        self._starving: list[Residence] = []  # loads past adapter_wait_s without a slot, in order
        self._orphans: dict[int, list[int]] = {}  # slot -> pages of a copy whose version was removed meanwhile
        self.recent = RecentAdapters()  # per tenant, its recent versions: what to prefetch
        self.prefetch = PrefetchQueue(limits.max_prefetches)
        self._order = itertools.count()
        self.yields = 0  # busy versions made to yield their slot to a starving load
        self.evictions: deque[float] = deque()  # times of pool evictions in the last EVICTION_WINDOW_S
        self.history: deque[HistoryEntry] = deque(maxlen=HISTORY_LEN)
        self._hot_order: list[str] = []  # the traffic tiers' hot versions, most requested first (set_hot)

    # -- registry -----------------------------------------------------------------------------------

    def add(self, key: str, pages: int, cold: LoadTier = LoadTier.DISK, host_bytes: int = 0) -> None:
        """Register version ``key`` of ``pages`` pool pages and a packed copy of ``host_bytes``,
        found in ``cold`` outside host RAM."""
        if key in self.adapters:
            raise ConflictError(f"adapter {key!r} is already registered", param="name")
        self.adapters[key] = Residence(key, pages, host_bytes, cold)

    def get(self, key: str) -> Residence:
        try:
            return self.adapters[key]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {key!r} does not exist", param="model") from None

    def set_cold(self, key: str, tier: LoadTier) -> None:
        """``key`` is now found in ``tier`` (DISK or REMOTE) outside host RAM (a download landed,
        or a disk cache let it go)."""
        self.get(key).cold = tier

    def check_removable(self, key: str) -> None:
        """Refuse (409) removing ``key`` while requests for it are queued or running."""
        r = self.get(key)
        if r.running or r.waiting:
            raise AdapterBusyError(
                f"adapter {key!r} has {r.running} running and {r.waiting} queued requests; retry once they finish"
            )

    def remove(self, key: str, now: float) -> list[Decision]:
        """Forget ``key``; refused while requests for it are queued or running. A copy in flight
        keeps its slot and pages until it reports back (it may still write them)."""
        self.check_removable(key)
        r = self.get(key)
        out: list[Decision] = []
        if r.phase is Phase.READING or key in self.prefetch.running:
            out.append(Cancel(key))
        self.prefetch.forget(key)
        r.pinned = r.hot = False  # deleting a version drops its pin with it
        if r.phase is Phase.PLACING:
            out += self._end_wait(r)
        elif r.phase is Phase.COPYING:
            self._orphans[r.slot] = r.page_ids
        elif r.phase is Phase.RESIDENT:
            out += self._evict(r, now)
        if key in self._host:
            self._host_bytes -= self._host.pop(key)
            out.append(DropHost(key))
        self.recent.forget(key)
        self._loads.pop(key, None)
        del self.adapters[key]
        return self._log("remove", key, out)

    # -- what callers ask -----------------------------------------------------------------------

    def tier(self, key: str) -> str:
        """Where ``key`` is now: ``gpu`` (resident), ``ram`` (host copy), ``disk`` or ``remote``."""
        r = self.get(key)
        return GPU if r.phase is Phase.RESIDENT else RAM if key in self._host else r.cold.value

    def falls_to(self, key: str) -> LoadTier:
        """Where a load of ``key`` would start now (for a resident version: where it would fall
        to if evicted; its host copy stays)."""
        return LoadTier.RAM if key in self._host else self.get(key).cold

    def is_ready(self, key: str) -> bool:
        """Resident and taking requests (a yielding version takes none)."""
        r = self.get(key)
        return r.phase is Phase.RESIDENT and not r.yielding

    def is_resident(self, key: str) -> bool:
        return self.get(key).phase is Phase.RESIDENT

    def is_busy(self, key: str) -> bool:
        """Requests for ``key`` are queued or running."""
        r = self.get(key)
        return bool(r.running or r.waiting)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def resident(self) -> list[str]:
        return [r.key for r in self._by_slot.values()]

    def resident_pages(self) -> dict[str, int]:
        """Pool pages of each resident version."""
        return {r.key: len(r.page_ids) for r in self._by_slot.values()}

    def in_host(self) -> list[str]:
        """Versions with a packed copy in host RAM, least recently used first."""
        return list(self._host)

    def host_bytes(self) -> int:
        """Bytes the packed copies in host RAM take together."""
        return self._host_bytes

    def pinned(self) -> list[str]:
        return [r.key for r in self.adapters.values() if r.pinned]

    def hot(self) -> list[str]:
        """Versions kept resident for their traffic (:meth:`set_hot`), most requested first."""
        return [k for k in self._hot_order if (r := self.adapters.get(k)) is not None and r.hot]

    def loading(self) -> list[str]:
        """Versions with a load in flight."""
        return list(self._loads)

    def value_per_page(self, r: Residence, now: float) -> float:
        """What ``r``'s pool pages are worth: its recent request rate x the cost of reloading it
        from the tier it would fall to / its pages."""
        return value_per_page(r.rate_at(now), self.costs.reload_s(self.falls_to(r.key), r.pages), r.pages)

    # -- the requests a version serves: queued (``waiting``) and admitted (``running``) ------------

    def enqueue(self, key: str, now: float, tenant: str | None = None) -> list[Decision]:
        """A request for ``key`` (from ``tenant``) arrived: count it as queued, note the traffic,
        and start the load now; queue prefetches of the tenant's other recent versions."""
        r = self.get(key)
        r.waiting += 1
        r.touch(now)
        out = self._ensure(r)
        if tenant is not None:
            wanted = [k for k in self.recent.use(tenant, key, now) if self._wants_prefetch(k)]
            self.prefetch.offer(wanted, tenant)
            out += self._start_prefetches()
        return self._log("enqueue", key, out)

    def dequeue(self, key: str) -> None:
        """A queued request for ``key`` left without running (aborted, or its load failed)."""
        self.get(key).waiting -= 1

    def admit(self, key: str) -> int:
        """A queued request for ``key`` is admitted: it runs on the version, which stays resident
        for it; its lora slot."""
        r = self.get(key)
        if r.phase is not Phase.RESIDENT:
            raise RuntimeError(f"adapter {key!r} admitted while not resident")  # an engine bug, never silent
        r.running += 1
        r.waiting -= 1
        return r.slot

    def finish(self, key: str) -> None:
        """An admitted request for ``key`` ended."""
        self.get(key).running -= 1

    def requeue(self, key: str) -> None:
        """An admitted request for ``key`` goes back to the queue (preempted, or its admission
        undone)."""
        r = self.get(key)
        r.running -= 1
        r.waiting += 1

    # -- admin ----------------------------------------------------------------------------------

    def ensure(self, key: str) -> list[Decision]:
        """Start making ``key`` resident if it is not, nor loading (pre-warm, pins)."""
        return self._log("ensure", key, self._ensure(self.get(key)))

    def unload(self, key: str, now: float) -> list[Decision]:
        """Drop ``key`` from the pool (its host copy stays) unless requests run on it or it is
        pinned; nothing when it is not resident. A version kept for being hot is let go (until the
        tiers are next set)."""
        r = self.get(key)
        if r.running:
            raise AdapterBusyError(f"adapter {key!r} has {r.running} running requests")
        if r.pinned:
            raise ConflictError(f"adapter {key!r} is pinned resident; unpin it first", param="id")
        r.hot = False
        return self._log("unload", key, self._evict(r, now) if r.phase is Phase.RESIDENT else [])

    def pin_limit(self) -> int:
        return self.limits.pins.limit() if self.limits.pins is not None else 0

    def pinned_pages(self) -> int:
        """Pool pages the pinned versions take (loaded or not yet)."""
        return sum(r.pages for r in self.adapters.values() if r.pinned)

    def check_pin(self, key: str) -> None:
        """Refuse (409) pinning ``key`` past the bounds (:class:`~lorapage.adapters.pins.PinBounds`)."""
        r = self.get(key)
        if r.pinned:
            return
        if self.limits.pins is None:
            raise ConflictError("pins are not enabled here", param="id")
        pinned = sum(1 for x in self.adapters.values() if x.pinned)
        self.limits.pins.check(key, r.pages, self.pinned_pages(), pinned)

    def pin(self, key: str) -> list[Decision]:
        """An admin pins ``key``: from now on it is never evicted nor made to yield. This does not
        start its load (:meth:`ensure` does)."""
        self.check_pin(key)
        r = self.get(key)
        r.pinned = True
        self._shed_hot()
        out: list[Decision] = []
        if r.yielding:  # the load it yielded to makes another version yield instead
            r.yielding = False
            out.append(Ready(key))
        return self._log("pin", key, out)

    # -- traffic tiers (lorapage.adapters.tiers) ----------------------------------------------

    def set_hot(self, keys: list[str]) -> list[Decision]:
        """The hot versions, most requested first: each one the pins' bounds still have room for
        beside the admin pins (and the hot ones before it) is kept resident as a pin is, and its
        load starts (a pre-warm: it makes no busy version yield); any other version, hot no more
        or past the bounds, is evictable by value again."""
        self._hot_order = [k for k in keys if k in self.adapters]
        for r in self.adapters.values():
            r.hot = False
        pages, count = self.pinned_pages(), len(self.pinned())
        out: list[Decision] = []
        for key in self._hot_order:
            r = self.adapters[key]
            if r.pinned or self.limits.pins is None or not self.limits.pins.fits(r.pages, pages, count):
                continue  # an admin pin holds it already, or no room is left for it
            r.hot = True
            pages, count = pages + r.pages, count + 1
            if r.yielding:
                r.yielding = False
                out.append(Ready(key))
            out += self._ensure(r)
        return self._log("set_hot", "", out)

    def prewarm(self, keys: list[str]) -> list[Decision]:
        """The warm versions, most requested first: read into host RAM ahead of their requests,
        those not there nor in the pool (nor remote: no download on speculation), as prefetches
        under the tiers' own share. Only the first ``max_cpu_loras`` / 2 are considered, so warm
        copies take at most half of host RAM, and no more are queued than the queue holds."""
        wanted = [k for k in keys[: self.limits.max_cpu_loras // 2] if self._wants_prefetch(k)]
        room = PREFETCH_QUEUE_LEN - len(self.prefetch.waiting)
        self.prefetch.offer(wanted[: max(0, room)], TIERS_TENANT)
        return self._log("prewarm", "", self._start_prefetches())

    def _shed_hot(self) -> None:
        """Let go of hot versions, least requested first, until admin pins and hot ones together
        are inside the pins' bounds again (an admin pin never waits for a hot one)."""
        bounds = self.limits.pins
        if bounds is None:
            return
        kept = [self.adapters[k] for k in self.hot()]
        pages = self.pinned_pages() + sum(r.pages for r in kept if not r.pinned)
        count = len(self.pinned()) + sum(1 for r in kept if not r.pinned)
        while kept and not bounds.within(pages, count):
            r = kept.pop()
            r.hot = False
            if not r.pinned:
                pages, count = pages - r.pages, count - 1

    def unpin(self, key: str) -> None:
        """Undo :meth:`pin`: ``key`` stays where it is, evictable by value again."""
        self.get(key).pinned = False

    def reset(self) -> list[Decision]:
        """The reads and copies in flight died (their event loop is gone): every load starts
        over, and the pinned versions' loads start. Slots and pages reserved for a copy that
        died stay taken (it may still write them)."""
        for r in self._loads.values():
            if r.phase is Phase.COPYING:
                self._orphans[r.slot] = r.page_ids
            r.phase, r.slot, r.page_ids, r.yielded = Phase.COLD, 0, [], None
            r.downloading = r.joined = False
        self._loads.clear()
        self._starving.clear()
        self.prefetch.clear()
        for r in self.adapters.values():
            r.yielding = False
        out: list[Decision] = []
        for r in list(self.adapters.values()):
            if r.pinned or r.hot:
                out += self._ensure(r)
        return self._log("reset", "", out)

    # -- what the loader reports ------------------------------------------------------------------

    def read_done(self, key: str, now: float) -> list[Decision]:
        """``key``'s packed copy is in host RAM: its load looks for room now."""
        r = self.get(key)
        if r.phase is not Phase.READING:
            return []
        r.downloading = False
        out = self._keep_in_host(key)
        r.phase, r.since, r.order = Phase.PLACING, now, next(self._order)
        out += self._start_prefetches()  # this load reads no more: queued prefetches may run
        out += self._place(now)
        return self._log("read_done", key, out)

    def downloaded(self, key: str) -> None:
        """``key``'s load finished its download (the files are on disk now) and reads them."""
        r = self.adapters.get(key)
        if r is not None:
            r.downloading = False
            r.cold = LoadTier.DISK

    def load_failed(self, key: str) -> list[Decision]:
        """``key``'s load failed before its copy (a read, a download): it is cold again (a later
        request retries)."""
        r = self.adapters.get(key)
        if r is None or r.phase is not Phase.READING:
            return []
        self._drop_load(r)
        return self._log("load_failed", key, self._start_prefetches())

    def prefetch_done(self, key: str, ok: bool) -> list[Decision]:
        """The prefetch of ``key`` ended: its packed copy is in host RAM (``ok``), or it failed;
        a load that joined it reads now (for itself, when it failed)."""
        self.prefetch.done(key, ok)
        r = self.adapters.get(key)
        out: list[Decision] = []
        if r is not None:
            if ok:
                out += self._keep_in_host(key)
            if r.phase is Phase.READING and r.joined:
                r.joined = False
                out.append(Read(key, r.load_tier or r.cold))  # from host RAM when the prefetch got there
        out += self._start_prefetches()
        return self._log("prefetch_done", key, out)

    def copy_done(self, key: str, slot: int, ok: bool, now: float) -> list[Decision]:
        """The copy of ``key`` into ``slot`` ended: resident (``ok``), or its slot and pages go back."""
        if slot in self._orphans:  # removed meanwhile
            self._give_back(slot, self._orphans.pop(slot))
            return self._log("copy_done", key, [Release(key, slot)])
        r = self.get(key)
        if not ok:
            self._give_back(slot, r.page_ids)
            self._drop_load(r)
            return self._log("copy_done", key, [Release(key, slot), *self._start_prefetches()])
        r.phase, r.resident_since = Phase.RESIDENT, now
        del self._loads[key]
        self._by_slot[slot] = r
        return self._log("copy_done", key, [Ready(key), *self._start_prefetches()])

    # -- loads waiting for room ---------------------------------------------------------------------

    def tick(self, now: float) -> list[Decision]:
        """Let the loads waiting for room take what freed (slots, pages, idle versions), or, past
        ``adapter_wait_s``, make a busy version yield. Call it after anything that may have made
        room, and at :meth:`next_check`."""
        return self._log("tick", "", self._place(now))

    def next_check(self, now: float) -> float | None:
        """The next time a waiting load's state changes with time alone (None: only events)."""
        times = []
        wait = self.limits.adapter_wait_s
        for r in self._loads.values():
            if r.phase is Phase.PLACING and r.yielded is None and r.since + wait > now:
                times.append(r.since + wait)  # PATIENT until then
        if self._starving and self._starving[0].yielded is None:  # none may yield yet: when one may
            times += [
                x.resident_since + wait
                for x in self._by_slot.values()
                if not x.yielding and not x.pinned and not x.hot and x.resident_since + wait > now
            ]
        return min(times) if times else None

    def pending_pages(self) -> int:
        """Pages to keep free for the largest load waiting on memory, so KV demand cannot starve
        it. Zero when that load could not proceed anyway (no slot to take, or more pages than
        freeing the whole KV cache would give): reserving then would only block admission."""
        waiting = [
            r for r in self._loads.values() if r.phase is not Phase.COPYING and (r.waiting or r.pinned)
        ]  # a pin is demand too
        if not waiting:
            return 0
        need = max(r.pages for r in waiting)
        # Idle versions can be evicted now; yielding ones will be, for the load they yield to.
        freeable = [r for r in self._by_slot.values() if r.yielding or self._idle(r)]
        attainable = self.pages.num_free + self.pages.used[PageKind.KV] + sum(r.pages for r in freeable)
        return need if (self._free_slots or freeable) and need <= attainable else 0

    def reclaim(self, pages_needed: int, now: float) -> list[Decision]:
        """Free pages until ``pages_needed`` are free (for KV blocks): idle cached blocks and idle
        versions in one ranking, least valuable per page first."""
        return self._log("reclaim", "", self._reclaim(pages_needed, now))

    # -- internals --------------------------------------------------------------------------------

    def _log(self, event: str, key: str, out: list[Decision]) -> list[Decision]:
        if out:
            self.history.append((event, key, tuple(out)))
        return out

    def _ensure(self, r: Residence) -> list[Decision]:
        if r.phase is not Phase.COLD:
            return []
        self._loads[r.key] = r
        r.phase = Phase.READING
        r.load_tier = self.falls_to(r.key)
        if r.load_tier is not LoadTier.RAM and r.key in self.prefetch.running:
            r.joined = True  # a load of a version being prefetched joins that read
            return []
        if r.load_tier is LoadTier.REMOTE:  # no file is read until the download is done: prefetches may
            r.downloading = True
            return [Read(r.key, r.load_tier), *self._start_prefetches()]
        return [Read(r.key, r.load_tier)]

    def _drop_load(self, r: Residence) -> None:
        r.phase, r.slot, r.page_ids = Phase.COLD, 0, []
        r.downloading = r.joined = False
        self._loads.pop(r.key, None)

    def _keep_in_host(self, key: str) -> list[Decision]:
        """``key``'s packed copy is the most recently used in host RAM; the least recently used
        copies leave while the LRU holds more than ``max_cpu_loras`` copies or more than
        ``max_cpu_lora_bytes`` bytes. A copy larger than that bound alone leaves at once, and
        nothing else for it (its load still has the copy in hand)."""
        size, most_bytes = self.adapters[key].host_bytes, self.limits.max_cpu_lora_bytes
        if most_bytes is not None and size > most_bytes:
            if key in self._host:
                self._host_bytes -= self._host.pop(key)
            return [DropHost(key)]
        if key not in self._host:
            self._host[key] = size
            self._host_bytes += size
        self._host.move_to_end(key)
        out: list[Decision] = []
        while self._host and (
            len(self._host) > self.limits.max_cpu_loras or (most_bytes is not None and self._host_bytes > most_bytes)
        ):
            dropped, size = self._host.popitem(last=False)
            self._host_bytes -= size
            out.append(DropHost(dropped))
        return out

    def _idle(self, r: Residence) -> bool:
        return r.running == 0 and r.waiting == 0 and not r.pinned and not r.hot

    def _idle_values(self, now: float) -> list[tuple[float, str]]:
        return [(self.value_per_page(r, now), r.key) for r in self._by_slot.values() if self._idle(r)]

    def _reclaim(self, pages_needed: int, now: float) -> list[Decision]:
        out: list[Decision] = []
        self.reclaimer.run(
            pages_needed, self._idle_values(now), lambda k: out.extend(self._evict(self.adapters[k], now))
        )
        return out

    def _evict(self, r: Residence, now: float) -> list[Decision]:
        slot = r.slot
        del self._by_slot[slot]
        self._give_back(slot, r.page_ids)
        r.phase, r.slot, r.page_ids, r.yielding = Phase.COLD, 0, [], False
        self.evictions.append(now)
        while now - self.evictions[0] > EVICTION_WINDOW_S:
            self.evictions.popleft()
        out: list[Decision] = [Evict(r.key, slot)]
        if r.waiting:  # queued (e.g. preempted) requests still need it: its reload starts
            out += self._ensure(r)
        return out

    def _give_back(self, slot: int, pages: list[int]) -> None:
        """Return a slot and its pages (an evicted version's, or a load's that never became one)."""
        self.pages.free(pages, PageKind.ADAPTER)
        self._free_slots.append(slot)

    def _place(self, now: float) -> list[Decision]:
        """Each load waiting for room, longest waiting first, tries again; again while a pass
        changed anything (an eviction or a yield may let an earlier load in)."""
        out: list[Decision] = []
        while self._loads:
            placing = sorted(
                (r for r in self._loads.values() if r.phase is Phase.PLACING), key=lambda r: (r.since, r.order)
            )
            changed: list[Decision] = []
            for r in placing:
                if r.phase is Phase.PLACING:  # not placed or removed earlier in this pass
                    changed += self._try_place(r, now)
            out += changed
            if not changed:
                break
        return out

    def _try_place(self, r: Residence, now: float) -> list[Decision]:
        """One look at ``r``'s room, as its :class:`LoadWait` state allows."""
        out: list[Decision] = []
        while True:
            if r.yielded is not None and not r.yielded.yielding:
                r.yielded = None  # evicted or pinned meanwhile: make another yield if still starving
            room = self._take_room(r, now, out)
            if room is not None:
                slot, pages = room
                out += self._end_wait(r)
                r.phase, r.slot, r.page_ids = Phase.COPYING, slot, pages
                out.append(Load(r.key, slot, tuple(pages)))
                return out
            state = self._wait_state(r, now)
            if state is LoadWait.PREWARM:
                self._leave_line(r)
            elif state is LoadWait.STARVING:
                if r not in self._starving:
                    self._starving.append(r)
                if self._starving[0] is r:
                    r.yielded = self._make_one_yield(now)
                    if r.yielded is not None:
                        out.append(Yield(r.yielded.key))
                        continue  # it may be idle of running requests already
            return out

    def _take_room(self, r: Residence, now: float, out: list[Decision]) -> tuple[int, list[int]] | None:
        """A lora slot and ``r``'s pages if they can be had now: an idle version gives up its
        slot, or the one that yielded to ``r`` does once it is idle and its pages complete the room."""
        need = r.pages
        if not self._free_slots:
            idle = self._idle_values(now)
            if idle:
                out += self._evict(self.adapters[min(idle)[1]], now)
            elif r.yielded is not None and r.yielded.running == 0:
                held = len(r.yielded.page_ids)
                if self.pages.num_free + held < need:  # no version is idle: idle cached blocks complete the room
                    self.reclaimer.run(need - held, [], lambda k: None)
                if self.pages.num_free + held >= need:
                    out += self._evict(r.yielded, now)  # it yielded for this load: its slot and pages are ours
        if self._free_slots and (self.pages.num_free >= need or self._reclaim_into(need, now, out)):
            pages = self.pages.allocate(need, PageKind.ADAPTER)
            if pages is not None:
                return self._free_slots.pop(), pages
        return None

    def _reclaim_into(self, need: int, now: float, out: list[Decision]) -> bool:
        out += self._reclaim(need, now)
        return self.pages.num_free >= need

    def _wait_state(self, r: Residence, now: float) -> LoadWait:
        if r.yielded is not None:
            return LoadWait.YIELDED
        if self._free_slots:
            return LoadWait.ROOM
        if now - r.since < self.limits.adapter_wait_s:
            return LoadWait.PATIENT
        # An admin pin is demand too: it may make a busy version yield, as waiting requests do.
        return LoadWait.STARVING if r.waiting or r.pinned else LoadWait.PREWARM

    def _leave_line(self, r: Residence) -> None:
        if r in self._starving:
            self._starving.remove(r)

    def _end_wait(self, r: Residence) -> list[Decision]:
        """``r`` waits for room no more (placed, or removed): out of the line, and the version
        that yielded to it, if not evicted, admits again."""
        self._leave_line(r)
        y, r.yielded = r.yielded, None
        if y is not None and y.yielding:
            y.yielding = False
            return [Ready(y.key)]
        return []

    def _make_one_yield(self, now: float) -> Residence | None:
        """Stop admitting to the busy resident version of least value per page (as eviction
        ranks them; pinned ones never), so its slot frees once its running requests finish. Its
        queued requests wait and reload it afterwards: busy versions take turns rather than one
        holding on forever. A version resident for less than ``adapter_wait_s`` is spared, so
        every turn lasts at least that long and the slot does not change hands after every batch."""
        wait = self.limits.adapter_wait_s
        busy = [
            (self.value_per_page(x, now), x.key)
            for x in self._by_slot.values()
            if not x.yielding and not x.pinned and not x.hot and now - x.resident_since >= wait
        ]
        if not busy:
            return None
        victim = self.adapters[min(busy)[1]]
        victim.yielding = True
        self.yields += 1
        return victim

    def _wants_prefetch(self, key: str) -> bool:
        """Registered, in no tier above disk, not loading nor prefetching. Remote sources not in
        the disk cache are left alone: no downloads on speculation."""
        r = self.adapters.get(key)
        if r is None or r.phase is not Phase.COLD or key in self._host or key in self.prefetch.running:
            return False
        return r.cold is LoadTier.DISK

    def _start_prefetches(self) -> list[Decision]:
        """Start queued prefetches while no load into the pool is reading files (a prefetch never
        delays one: it waits, and runs once the loads have their host copies)."""
        if not self.prefetch.max_running or self._loads_reading():
            return []
        return [Prefetch(key, tenant) for key, tenant in self.prefetch.start(self._wants_prefetch)]

    def _loads_reading(self) -> bool:
        """Whether a load into the pool is reading files or about to (no host copy yet, not
        waiting on a download)."""
        return any(
            r.phase is Phase.READING and r.key not in self._host and not r.downloading for r in self._loads.values()
        )

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
- KV admission keeps :meth:`~lorapage.adapters.loads.Loads.pending_pages` free for the largest
  load waiting on memory.

The rules take the time as an argument and answer with *decisions*
(:mod:`lorapage.adapters.decisions`): what to read, prefetch, copy into which slot and pages,
evict, drop from host RAM. Whoever drives them
carries the decisions out and reports back when a read or a copy is done: the engine's
:class:`~lorapage.adapters.cache.AdapterCache` with I/O threads and the device, the simulator's
:class:`~lorapage.sim.loader.SimLoader` on a virtual clock. So a rule is written once, here.

Every event that decided something is kept in :attr:`Residency.history` (bounded) with its
decisions: the engine and the simulator can be compared decision by decision.

:class:`Residency` takes every event and answers the questions that span tiers (:meth:`~Residency.tier`,
:meth:`~Residency.is_ready`); each tier's own state and rules are a part of it, which readers ask
directly: :attr:`~Residency.slots` (the pool's lora slots and pages, eviction by value;
:mod:`lorapage.adapters.pool_slots`), :attr:`~Residency.host` (the host-RAM LRU;
:mod:`lorapage.adapters.host_ram`), :attr:`~Residency.loads` (loads in flight and their wait for
room, yields; :mod:`lorapage.adapters.loads`), :attr:`~Residency.pins` (admin pins and hot
versions; :mod:`lorapage.adapters.pins`), :attr:`~Residency.prefetch` (queued and running prefetches;
:mod:`lorapage.adapters.prefetch`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lorapage.adapters.decisions import Cancel, Decision, DropHost, Prefetch, Read, Ready, Release
from lorapage.adapters.host_ram import HostRam
from lorapage.adapters.loads import Loads
from lorapage.adapters.pins import PinBounds, Pins
from lorapage.adapters.pool_slots import PoolSlots
from lorapage.adapters.prefetch import PREFETCH_QUEUE_LEN, PrefetchQueue
from lorapage.adapters.residence import AdapterPages, Phase, ReloadCost, Residence, lookup
from lorapage.adapters.value import LoadTier, RecentAdapters
from lorapage.errors import AdapterBusyError, ConflictError
from lorapage.memory.reclaim import Reclaim

GPU, RAM = "gpu", "ram"  # tiers above the cold ones (LoadTier.DISK, LoadTier.REMOTE)
TIERS_TENANT = "(traffic tiers)"  # whose share the warm versions' prefetches take (no tenant is named so)
HISTORY_LEN = 512  # events kept with their decisions


@dataclass(frozen=True)
class ResidencyLimits:
    """The sizes and times the rules work within (vLLM names where the engine has them)."""

    max_resident_loras: int  # lora slots: versions resident in the pool at once
    max_cpu_loras: int  # packed copies in host RAM
    adapter_wait_s: float = 1.0  # a load finding every slot busy this long may make one yield
    max_prefetches: int = 0  # prefetches into host RAM running at once (0: none)
    pins: PinBounds | None = None  # None: pins refused (no bounds given)
    max_cpu_lora_bytes: int | None = None  # bytes of the packed copies in host RAM together; None: no bound


HistoryEntry = tuple[str, str, tuple[Decision, ...]]  # (event, the key it was about or "", decisions)


class Residency:
    """Every version's tier, its load, its requests and its pins, under the rules of this module."""

    def __init__(self, limits: ResidencyLimits, pages: AdapterPages, reclaim: Reclaim, costs: ReloadCost) -> None:
        self.limits, self.pages = limits, pages
        self.adapters: dict[str, Residence] = {}
        self.host = HostRam(limits.max_cpu_loras, limits.max_cpu_lora_bytes)  # the LRU of packed copies
        self.slots = PoolSlots(limits.max_resident_loras, pages, reclaim, costs, self.host)  # slots, eviction
        self.loads = Loads(limits.adapter_wait_s, self.slots, pages, self.host, self._evict)  # in flight, yields
        self.pins = Pins(limits.pins, self.adapters)  # admin pins and hot versions, within the bounds
        self.recent = RecentAdapters()  # per tenant, its recent versions: what to prefetch
        self.prefetch = PrefetchQueue(limits.max_prefetches)
        self.history: deque[HistoryEntry] = deque(maxlen=HISTORY_LEN)

    # -- registry -----------------------------------------------------------------------------------

    def add(self, key: str, pages: int, cold: LoadTier = LoadTier.DISK, host_bytes: int = 0) -> None:
        """Register version ``key`` of ``pages`` pool pages and a packed copy of ``host_bytes``,
        found in ``cold`` outside host RAM."""
        if key in self.adapters:
            raise ConflictError(f"adapter {key!r} is already registered", param="name")
        self.adapters[key] = Residence(key, pages, host_bytes, cold)

    def get(self, key: str) -> Residence:
        return lookup(self.adapters, key)

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
            out += self.loads.end_wait(r)
        elif r.phase is Phase.COPYING:
            self.slots.orphan(r.slot, r.page_ids)
        elif r.phase is Phase.RESIDENT:
            out += self._evict(r, now)
        if self.host.drop(key):
            out.append(DropHost(key))
        self.recent.forget(key)
        self.loads.drop(r)
        del self.adapters[key]
        return self._log("remove", key, out)

    # -- what callers ask (each tier's own state: slots, host, loads, pins, prefetch) ----------------

    def tier(self, key: str) -> str:
        """Where ``key`` is now: ``gpu`` (resident), ``ram`` (host copy), ``disk`` or ``remote``."""
        r = self.get(key)
        return GPU if r.phase is Phase.RESIDENT else RAM if key in self.host else r.cold.value

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

    def admit(self, key: str, now: float) -> int:
        """A queued request for ``key`` is admitted at ``now``: it runs on the version, which
        stays resident for it (the first since it became resident starts its turn); its lora slot."""
        r = self.get(key)
        if r.phase is not Phase.RESIDENT:
            raise RuntimeError(f"adapter {key!r} admitted while not resident")  # an engine bug, never silent
        r.running += 1
        r.waiting -= 1
        if r.turn_since is None:
            r.turn_since = now
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
        if r.running == 0:  # served nothing yet, or its service lost with the KV: its turn starts again
            r.turn_since = None

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

    def pin(self, key: str) -> list[Decision]:
        """An admin pins ``key`` within the bounds (:meth:`Pins.pin`): from now on it is never
        evicted nor made to yield. This does not start its load (:meth:`ensure` does)."""
        r = self.pins.pin(key)
        out: list[Decision] = []
        if r.yielding:  # the load it yielded to makes another version yield instead
            r.yielding = False
            out.append(Ready(key))
        return self._log("pin", key, out)

    def unpin(self, key: str) -> None:
        """Undo :meth:`pin`: ``key`` stays where it is, evictable by value again."""
        self.get(key).pinned = False

    # -- traffic tiers (lorapage.adapters.tiers) ----------------------------------------------

    def set_hot(self, keys: list[str]) -> list[Decision]:
        """The hot versions, most requested first: each one the pins' bounds still have room for
        beside the admin pins (and the hot ones before it) is kept resident as a pin is
        (:meth:`Pins.set_hot`), and its load starts (a pre-warm: it makes no busy version yield);
        any other version, hot no more or past the bounds, is evictable by value again."""
        out: list[Decision] = []
        for r in self.pins.set_hot(keys):
            if r.yielding:
                r.yielding = False
                out.append(Ready(r.key))
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

    def reset(self) -> list[Decision]:
        """The reads and copies in flight died (their event loop is gone): every load starts
        over, and the pinned versions' loads start. Slots and pages reserved for a copy that
        died stay taken (it may still write them)."""
        self.loads.clear()
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
        out: list[Decision] = [*self.host.keep(key, r.host_bytes)]
        self.loads.wait_for_room(r, now)
        out += self._start_prefetches()  # this load reads no more: queued prefetches may run
        out += self.loads.place(now)
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
        self.loads.drop(r)
        return self._log("load_failed", key, self._start_prefetches())

    def prefetch_done(self, key: str, ok: bool) -> list[Decision]:
        """The prefetch of ``key`` ended: its packed copy is in host RAM (``ok``), or it failed;
        a load that joined it reads now (for itself, when it failed)."""
        self.prefetch.done(key, ok)
        r = self.adapters.get(key)
        out: list[Decision] = []
        if r is not None:
            if ok:
                out += self.host.keep(key, r.host_bytes)
            if r.phase is Phase.READING and r.joined:
                r.joined = False
                out.append(Read(key, r.load_tier or r.cold))  # from host RAM when the prefetch got there
        out += self._start_prefetches()
        return self._log("prefetch_done", key, out)

    def copy_done(self, key: str, slot: int, ok: bool, now: float) -> list[Decision]:
        """The copy of ``key`` into ``slot`` ended: resident (``ok``), or its slot and pages go back."""
        if self.slots.release_orphan(slot):  # removed meanwhile
            return self._log("copy_done", key, [Release(key, slot)])
        r = self.get(key)
        if not ok:
            self.slots.give_back(slot, r.page_ids)
            self.loads.drop(r)
            return self._log("copy_done", key, [Release(key, slot), *self._start_prefetches()])
        self.loads.settle(r, slot, now)
        return self._log("copy_done", key, [Ready(key), *self._start_prefetches()])

    # -- loads waiting for room, and memory for KV blocks -------------------------------------------

    def tick(self, now: float) -> list[Decision]:
        """Let the loads waiting for room take what freed (slots, pages, idle versions), or, past
        ``adapter_wait_s``, make a busy version yield. Call it after anything that may have made
        room, and at :meth:`Loads.next_check`."""
        return self._log("tick", "", self.loads.place(now))

    def reclaim(self, pages_needed: int, now: float) -> list[Decision]:
        """Free pages until ``pages_needed`` are free (for KV blocks): idle cached blocks and idle
        versions in one ranking, least valuable per page first (:meth:`PoolSlots.reclaim`)."""
        return self._log("reclaim", "", [*self.slots.reclaim(pages_needed, now)])

    # -- internals --------------------------------------------------------------------------------

    def _log(self, event: str, key: str, out: list[Decision]) -> list[Decision]:
        if out:
            self.history.append((event, key, tuple(out)))
        return out

    def _ensure(self, r: Residence) -> list[Decision]:
        if r.phase is not Phase.COLD:
            return []
        tier = self.loads.start(r)
        if tier is not LoadTier.RAM and r.key in self.prefetch.running:
            r.joined = True  # a load of a version being prefetched joins that read
            return []
        if tier is LoadTier.REMOTE:  # no file is read until the download is done: prefetches may
            r.downloading = True
            return [Read(r.key, tier), *self._start_prefetches()]
        return [Read(r.key, tier)]

    def _evict(self, r: Residence, now: float) -> list[Decision]:
        """``r`` leaves the pool; queued (e.g. preempted) requests still need it: its reload starts."""
        out: list[Decision] = [self.slots.evict(r, now)]
        if r.waiting:
            out += self._ensure(r)
        return out

    def _wants_prefetch(self, key: str) -> bool:
        """Registered, in no tier above disk, not loading nor prefetching. Remote sources not in
        the disk cache are left alone: no downloads on speculation."""
        r = self.adapters.get(key)
        if r is None or r.phase is not Phase.COLD or key in self.host or key in self.prefetch.running:
            return False
        return r.cold is LoadTier.DISK

    def _start_prefetches(self) -> list[Decision]:
        """Start queued prefetches while no load into the pool is reading files (a prefetch never
        delays one: it waits, and runs once the loads have their host copies)."""
        if not self.prefetch.max_running or self.loads.reading():
            return []
        return [Prefetch(key, tenant) for key, tenant in self.prefetch.start(self._wants_prefetch)]

"""The loads in flight and their wait for room: lora slots, pages, and busy versions made to yield (no torch).

A load reads a version's packed copy into host RAM (``READING``), then waits for a lora slot and
its pages (``PLACING``), then copies into them (``COPYING``). While it waits it is in one
:class:`LoadWait` state: a free slot but pages short (``ROOM``); every slot busy for less than
``adapter_wait_s`` (``PATIENT``); past that, with requests (or an admin pin) waiting for it, in
the line of starving loads (``STARVING``), whose first makes the busy version of least value per
page yield (``YIELDED``); with nothing waiting for it (a pre-warm), until a slot frees
(``PREWARM``). Each look at the waiting loads (:meth:`Loads.place`) takes what freed, longest
waiting first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from enum import Enum

from lorapage.adapters.decisions import Decision, Load, Ready, Yield
from lorapage.adapters.host_ram import HostRam
from lorapage.adapters.pool_slots import PoolSlots
from lorapage.adapters.residence import AdapterPages, Phase, Residence
from lorapage.adapters.value import LoadTier
from lorapage.memory.pages import PageKind


class LoadWait(Enum):
    """What a load that found no room waits for."""

    ROOM = "room"  # a lora slot is free but pages are short: until pages free
    YIELDED = "yielded"  # a busy adapter yields its slot to this load: until it is idle
    PATIENT = "patient"  # every slot busy for less than adapter_wait_s: until one frees, or adapter_wait_s
    STARVING = "starving"  # every slot busy for adapter_wait_s, requests wait: in line to make one yield
    PREWARM = "prewarm"  # every slot busy and no request waits (a pre-warm): until a slot frees


class Loads:
    """The versions with a load in flight, the line of starving loads, and the busy versions
    made to yield. ``evict`` is how a version leaves the pool (the residency's rule: a reload
    starts for its queued requests)."""

    def __init__(
        self,
        wait_s: float,
        slots: PoolSlots,
        pages: AdapterPages,
        host: HostRam,
        evict: Callable[[Residence, float], list[Decision]],
    ) -> None:
        self.wait_s, self.slots, self.pages, self.host, self._evict = wait_s, slots, pages, host, evict
        self._loads: dict[str, Residence] = {}  # READING, PLACING or COPYING
        self._starving: list[Residence] = []  # loads past adapter_wait_s without a slot, in order
        self._order = itertools.count()
        self.yields = 0  # busy versions made to yield their slot to a starving load

    def loading(self) -> list[str]:
        """Versions with a load in flight."""
        return list(self._loads)

    def __contains__(self, key: str) -> bool:
        return key in self._loads

    def start(self, r: Residence) -> LoadTier:
        """``r``'s load starts: it reads its packed copy from where it would fall to; that tier."""
        self._loads[r.key] = r
        r.phase = Phase.READING
        r.load_tier = tier = self.host.falls_to(r)
        return tier

    def drop(self, r: Residence) -> None:
        """``r``'s load ends without a copy into the pool (failed, or its version was removed)."""
        r.phase, r.slot, r.page_ids = Phase.COLD, 0, []
        r.downloading = r.joined = False
        self._loads.pop(r.key, None)

    def settle(self, r: Residence, slot: int, now: float) -> None:
        """``r``'s copy into ``slot`` is done: it is resident."""
        r.phase, r.turn_since = Phase.RESIDENT, None
        del self._loads[r.key]
        self.slots.settle(slot, r)

    def wait_for_room(self, r: Residence, now: float) -> None:
        """``r``'s packed copy is in hand: it waits for a lora slot and its pages from ``now``."""
        r.phase, r.since, r.order = Phase.PLACING, now, next(self._order)

    def reading(self) -> bool:
        """Whether a load is reading files or about to (no host copy yet, not waiting on a download)."""
        return any(
            r.phase is Phase.READING and r.key not in self.host and not r.downloading for r in self._loads.values()
        )

    def clear(self) -> None:
        """The reads and copies in flight died (their event loop is gone): no load is in flight.
        Slots and pages reserved for a copy that died stay taken (it may still write them)."""
        for r in self._loads.values():
            if r.phase is Phase.COPYING:
                self.slots.orphan(r.slot, r.page_ids)
            r.phase, r.slot, r.page_ids, r.yielded = Phase.COLD, 0, [], None
            r.downloading = r.joined = False
        self._loads.clear()
        self._starving.clear()

    def next_check(self, now: float) -> float | None:
        """The next time a waiting load's state changes with time alone (None: only events)."""
        times = []
        wait = self.wait_s
        for r in self._loads.values():
            if r.phase is Phase.PLACING and r.yielded is None and r.since + wait > now:
                times.append(r.since + wait)  # PATIENT until then
        if self._starving and self._starving[0].yielded is None:  # none may yield yet: when one may
            # A turn not started starts with an admission, which looks again (AdapterCache.admit).
            turns = [x.turn_since for x in self.slots.versions() if not (x.yielding or x.pinned or x.hot)]
            times += [t + wait for t in turns if t is not None and t + wait > now]
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
        freeable = [r for r in self.slots.versions() if r.yielding or r.idle]
        attainable = self.pages.num_free + self.pages.used[PageKind.KV] + sum(r.pages for r in freeable)
        return need if (self.slots.num_free or freeable) and need <= attainable else 0

    def place(self, now: float) -> list[Decision]:
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

    def end_wait(self, r: Residence) -> list[Decision]:
        """``r`` waits for room no more (placed, or removed): out of the line, and the version
        that yielded to it, if not evicted, admits again."""
        if r in self._starving:
            self._starving.remove(r)
        y, r.yielded = r.yielded, None
        if y is not None and y.yielding:
            y.yielding = False
            return [Ready(y.key)]
        return []

    def _try_place(self, r: Residence, now: float) -> list[Decision]:
        """One look at ``r``'s room, as its :class:`LoadWait` state allows."""
        out: list[Decision] = []
        while True:
            if r.yielded is not None and not r.yielded.yielding:
                r.yielded = None  # evicted or pinned meanwhile: make another yield if still starving
            room = self._take_room(r, now, out)
            if room is not None:
                slot, pages = room
                out += self.end_wait(r)
                r.phase, r.slot, r.page_ids = Phase.COPYING, slot, pages
                out.append(Load(r.key, slot, tuple(pages)))
                return out
            state = self._wait_state(r, now)
            if state is LoadWait.PREWARM:
                if r in self._starving:
                    self._starving.remove(r)
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
        if not self.slots.num_free:
            idle = self.slots.least_valuable_idle(now)
            if idle is not None:
                out += self._evict(idle, now)
            elif r.yielded is not None and r.yielded.running == 0:
                held = len(r.yielded.page_ids)
                if self.pages.num_free + held < need:  # no version is idle: idle cached blocks complete the room
                    self.slots.reclaimer.run(need - held, [], lambda k: None)
                if self.pages.num_free + held >= need:
                    out += self._evict(r.yielded, now)  # it yielded for this load: its slot and pages are ours
        if self.slots.num_free and (self.pages.num_free >= need or self._reclaim_into(need, now, out)):
            return self.slots.take(need)
        return None

    def _reclaim_into(self, need: int, now: float, out: list[Decision]) -> bool:
        out += self.slots.reclaim(need, now)
        return self.pages.num_free >= need

    def _wait_state(self, r: Residence, now: float) -> LoadWait:
        if r.yielded is not None:
            return LoadWait.YIELDED
        if self.slots.num_free:
            return LoadWait.ROOM
        if now - r.since < self.wait_s:
            return LoadWait.PATIENT
        # An admin pin is demand too: it may make a busy version yield, as waiting requests do.
        return LoadWait.STARVING if r.waiting or r.pinned else LoadWait.PREWARM

    def _make_one_yield(self, now: float) -> Residence | None:
        """Stop admitting to the busy resident version of least value per page (as eviction
        ranks them; pinned ones never), so its slot frees once its running requests finish. Its
        queued requests wait and reload it afterwards: busy versions take turns rather than one
        holding on forever. A turn runs from the version's first admission since it became
        resident and lasts at least ``adapter_wait_s``, so the slot does not change hands after
        every batch, nor before the version loaded for a queued request has served it (on a
        loaded machine its admission may wait longer than ``adapter_wait_s`` for KV room, and
        yielding then evicted it unserved and cycled the slot)."""
        busy = [
            x
            for x in self.slots.versions()
            if not x.yielding
            and not x.pinned
            and not x.hot
            and x.turn_since is not None
            and now - x.turn_since >= self.wait_s
        ]
        if not busy:
            return None
        victim = min(busy, key=lambda x: (self.slots.value_per_page(x, now), x.key))
        victim.yielding = True
        self.yields += 1
        return victim

"""The pool-slot tier: which versions hold a lora slot and their pages, and which leave for room (no torch).

There are ``max_resident_loras`` lora slots; a resident version holds one and the pool pages of
its A and B rows. A version leaves (is evicted) when room is needed: the idle ones (nothing
running or waiting, not pinned nor kept hot) of least value per page first, ranked with the
pool's idle cached KV blocks in one currency (:class:`~lorapage.memory.reclaim.Reclaim`).
"""

from __future__ import annotations

from collections import deque

from lorapage.adapters.decisions import Evict
from lorapage.adapters.host_ram import HostRam
from lorapage.adapters.residence import AdapterPages, Phase, ReloadCost, Residence
from lorapage.memory.pages import PageKind
from lorapage.memory.reclaim import Reclaim, value_per_page

EVICTION_WINDOW_S = 60.0  # evictions are remembered this long (for evictions per minute)


class PoolSlots:
    """The resident versions by lora slot, the free slots, and the pool pages they hold."""

    def __init__(self, count: int, pages: AdapterPages, reclaim: Reclaim, costs: ReloadCost, host: HostRam) -> None:
        self.pages, self.reclaimer, self.costs, self.host = pages, reclaim, costs, host
        self._free = list(range(count, 0, -1))  # popped from the end: the last freed first
        self._by_slot: dict[int, Residence] = {}  # resident versions
        self._orphans: dict[int, list[int]] = {}  # slot -> pages of a copy whose version was removed meanwhile
        self.evictions: deque[float] = deque()  # times of pool evictions in the last EVICTION_WINDOW_S

    @property
    def num_free(self) -> int:
        return len(self._free)

    def resident(self) -> list[str]:
        return [r.key for r in self._by_slot.values()]

    def resident_pages(self) -> dict[str, int]:
        """Pool pages of each resident version."""
        return {r.key: len(r.page_ids) for r in self._by_slot.values()}

    def versions(self) -> list[Residence]:
        """The resident versions."""
        return list(self._by_slot.values())

    def value_per_page(self, r: Residence, now: float) -> float:
        """What ``r``'s pool pages are worth: its recent request rate x the cost of reloading it
        from the tier it would fall to / its pages."""
        return value_per_page(r.rate_at(now), self.costs.reload_s(self.host.falls_to(r), r.pages), r.pages)

    def least_valuable_idle(self, now: float) -> Residence | None:
        """The idle resident version of least value per page (None: none is idle)."""
        idle = [r for r in self._by_slot.values() if r.idle]
        return min(idle, key=lambda r: (self.value_per_page(r, now), r.key)) if idle else None

    def take(self, need: int) -> tuple[int, list[int]] | None:
        """A free lora slot and ``need`` pages, reserved for a load's copy (None: not both to have)."""
        if not self._free:
            return None
        pages = self.pages.allocate(need, PageKind.ADAPTER)
        return (self._free.pop(), pages) if pages is not None else None

    def settle(self, slot: int, r: Residence) -> None:
        """``r``'s copy into ``slot`` and its pages is done: it is resident."""
        self._by_slot[slot] = r

    def evict(self, r: Residence, now: float) -> Evict:
        """``r`` leaves the pool: its slot and pages are free (its host copy stays)."""
        slot = r.slot
        del self._by_slot[slot]
        self.give_back(slot, r.page_ids)
        r.phase, r.slot, r.page_ids, r.yielding = Phase.COLD, 0, [], False
        self.evictions.append(now)
        while now - self.evictions[0] > EVICTION_WINDOW_S:
            self.evictions.popleft()
        return Evict(r.key, slot)

    def reclaim(self, pages_needed: int, now: float) -> list[Evict]:
        """Free pages until ``pages_needed`` are free: idle cached blocks and idle versions in one
        ranking, least valuable per page first."""
        out: list[Evict] = []
        idle = {r.key: r for r in self._by_slot.values() if r.idle}
        values = [(self.value_per_page(r, now), key) for key, r in idle.items()]
        self.reclaimer.run(pages_needed, values, lambda k: out.append(self.evict(idle[k], now)))
        return out

    def give_back(self, slot: int, pages: list[int]) -> None:
        """Return a slot and its pages (an evicted version's, or a load's that never became one)."""
        self.pages.free(pages, PageKind.ADAPTER)
        self._free.append(slot)

    def orphan(self, slot: int, pages: list[int]) -> None:
        """A copy into ``slot`` and ``pages`` is in flight for a version that is gone: they stay
        taken until it reports back (it may still write them)."""
        self._orphans[slot] = pages

    def release_orphan(self, slot: int) -> bool:
        """The copy into ``slot`` reported back: if its version was gone, its slot and pages are
        free now; whether it was."""
        if slot not in self._orphans:
            return False
        self.give_back(slot, self._orphans.pop(slot))
        return True

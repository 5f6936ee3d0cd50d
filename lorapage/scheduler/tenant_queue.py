"""Tenants in VTC order: per tenant its waiting requests and counter, kept in lazy min-heaps.

A tenant is IDLE (nothing waiting), ACTIVE (examined in counter order every step) or PARKED in
one of three heaps, by the kind of event that could let one of its requests in. Counters only
grow while an entry sits in a heap, so a stale entry is at worst too early: it is re-pushed when
it reaches the top. A tenant has at most one valid entry, the one carrying its current stamp;
the others are dropped when they reach the top, or all at once when they outnumber the valid
ones (so the heaps stay within twice the tenants that wait, however long the server runs).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic

from lorapage.scheduler.base import R
from lorapage.scheduler.lanes import Blocked

# Heap entries beyond twice the valid ones before the heaps are compacted: small heaps are not
# worth compacting, and the slack keeps compaction amortized O(1) per push.
_COMPACT_SLACK = 64


class TenantState(IntEnum):
    # IntEnum: hashed as an int in C (the heaps are keyed by state in every step's hot path).
    IDLE = 0  # nothing waiting
    ACTIVE = 1  # examined in VTC order every step
    PARKED_ANY = 2  # waits for any free lane (it has a single-request or aged opener)
    PARKED_GENERAL = 3  # waits for a free general lane
    PARKED_ADAPTER = 4  # waits only for its adapters: to finish loading, close or take joins again

    @classmethod
    def parked_for(cls, reason: Blocked) -> TenantState:
        return _PARKED_FOR[reason]

    @property
    def openness(self) -> int:
        """How many kinds of event can let it in: parked states only move up this order."""
        return _OPENNESS.get(self, 3)


# Built once: these are looked up for every request a step finds blocked.
_PARKED_FOR = {
    Blocked.ANY: TenantState.PARKED_ANY,
    Blocked.GENERAL: TenantState.PARKED_GENERAL,
    Blocked.ADAPTER: TenantState.PARKED_ADAPTER,
}
_OPENNESS = {TenantState.PARKED_ADAPTER: 0, TenantState.PARKED_GENERAL: 1, TenantState.PARKED_ANY: 2}


@dataclass(eq=False, slots=True)
class Waiting(Generic[R]):
    req: R
    enqueued_at: float  # arrival, or the requeue after a preemption: the age deadline counts from here


@dataclass(eq=False, slots=True)
class Tenant(Generic[R]):
    name: str
    in_cost: float  # counter units per prompt token: input_weight / weight
    out_cost: float  # counter units per generated token: output_weight / weight
    counter: float = 0.0
    waiting: dict[str, Waiting[R]] = field(default_factory=dict)  # request_id -> entry, oldest first
    state: TenantState = TenantState.IDLE
    stamp: int = -1  # stamp of its one valid heap entry; -1: none (idle, or taken out this step)


class TenantQueue(Generic[R]):
    """Every tenant by name, and one heap of (counter when pushed, stamp, name) per state."""

    def __init__(self) -> None:
        self.tenants: dict[str, Tenant[R]] = {}
        self._heaps: dict[TenantState, list[tuple[float, int, str]]] = {
            s: [] for s in TenantState if s is not TenantState.IDLE
        }
        self._stamp = 0
        self._valid = 0  # valid entries across the heaps: tenants whose stamp is not -1
        self._entries = 0  # entries across the heaps, stale ones included (kept, not summed: hot path)

    def set_state(self, t: Tenant[R], state: TenantState) -> None:
        """Move ``t`` to ``state`` (re-pushing it at its current counter)."""
        if t.stamp != -1:
            self._valid -= 1  # its entry goes stale
        t.state = state
        if state is TenantState.IDLE:
            t.stamp = -1
        else:
            self._stamp += 1
            t.stamp = self._stamp
            heapq.heappush(self._heaps[state], (t.counter, self._stamp, t.name))
            self._valid += 1
            self._entries += 1
        if self._entries > 2 * self._valid + _COMPACT_SLACK:
            self._compact()

    def take_out(self, t: Tenant[R]) -> None:
        """``t`` is being examined: its entry is spent until :meth:`put_back`."""
        if t.stamp != -1:
            self._valid -= 1
        t.stamp = -1

    def put_back(self, t: Tenant[R]) -> None:
        if t.stamp == -1 and t.state is not TenantState.IDLE:  # not re-pushed meanwhile
            self.set_state(t, t.state)

    def activate(self, t: Tenant[R]) -> None:
        if t.state is not TenantState.IDLE and t.state is not TenantState.ACTIVE:
            self.set_state(t, TenantState.ACTIVE)

    def counter_dropped(self, t: Tenant[R]) -> None:
        """``t``'s counter went down (a refund): its entry's key is now too high."""
        if t.state is not TenantState.IDLE and t.stamp != -1:
            self.set_state(t, t.state)

    def peek(self, state: TenantState) -> Tenant[R] | None:
        """The tenant in ``state`` with the smallest counter."""
        heap = self._heaps[state]
        while heap:
            key, stamp, name = heap[0]
            t = self.tenants[name]
            if stamp != t.stamp or t.state is not state:
                heapq.heappop(heap)
                self._entries -= 1
            elif key < t.counter:
                heapq.heappop(heap)
                self._entries -= 1
                self.set_state(t, state)
            else:
                return t
        return None

    def lowest(self, states: tuple[TenantState, ...]) -> Tenant[R] | None:
        found = [t for s in states if (t := self.peek(s)) is not None]
        return min(found, key=lambda t: (t.counter, t.stamp), default=None)

    def backlogged_lowest(self) -> Tenant[R] | None:
        return self.lowest(tuple(self._heaps))

    def heap_entries(self) -> int:
        """Entries in the heaps, stale ones included."""
        return self._entries

    def _compact(self) -> None:
        """Drop every stale entry. Valid entries keep their keys, and keys are unique (the stamp),
        so every later peek returns what it would have returned without the compaction."""
        for heap in self._heaps.values():
            # In place: peek may be iterating over this very list.
            heap[:] = [e for e in heap if self.tenants[e[2]].stamp == e[1]]
            heapq.heapify(heap)
        self._entries = sum(len(heap) for heap in self._heaps.values())

"""Distinct-adapter slots of the running batch: the cap, the reserved tail, the age deadline.

Decode cost grows with the number of distinct adapters in a step, so the batch holds at most
``cap`` of them. A request whose adapter is already in the batch *joins* it for free; one that
needs a new adapter *opens* a slot. While two or more general slots are free anyone may open one;
the last one goes to the adapter with the most waiting requests (biggest groups first, so slots
fill rows). ``tail`` of the ``cap`` slots are reserved for adapters with a single queued request,
and an adapter that came in through a tail slot takes no joins, so tail slots keep turning over
instead of being captured by hot adapters. A request older than the age
deadline that finds no slot *claims* the next general one: nobody else opens a general slot
until it is in, and the general holder that opened its slot first takes no joins until it
drains, so hot adapters rotate through the general slots instead of keeping them forever. Tail
slots stay open to single requests meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from lorapage.scheduler.base import SchedRequest


class SlotKind(Enum):
    """How an admissible request enters the batch."""

    BASE = "base"  # no adapter: needs no slot
    JOIN = "join"  # its adapter is already in the batch
    GENERAL = "general"  # opens one of the cap - tail general slots
    TAIL = "tail"  # opens one of the reserved tail slots


class Blocked(Enum):
    """Why a ready request cannot enter now, which says what event could let it in."""

    ADAPTER = "adapter"  # its adapter is in the batch but takes no joins (tail or draining)
    GENERAL = "general"  # it must open a general slot and none is free (to a group its size)
    ANY = "any"  # it may open any slot (single request or aged) but none is free, or it is claimed


class AdapterSlots:
    """Which adapters the running batch holds, and whether one more request may be admitted."""

    def __init__(self, cap: int, tail: int) -> None:
        self.cap = cap
        self.reserved_tail = tail
        self.running: dict[str, int] = {}  # adapter -> running requests using it, in opening order
        self.tail: set[str] = set()  # holders that opened a tail slot; they take no joins
        self.claim: SchedRequest | None = None  # an aged request owed the next slot that frees
        self.draining: str | None = None  # holder taking no joins so that the claim gets a slot
        self.changed: list[str] = []  # adapters that opened, closed or stopped draining (to wake waiters)

    def distinct(self) -> int:
        return len(self.running)

    def free_general(self) -> int:
        """General slots free (0 when the cap is reached)."""
        used = len(self.running)
        return max(0, min(self.cap - used, self.cap - self.reserved_tail - (used - len(self.tail))))

    def free_tail(self) -> bool:
        return len(self.running) < self.cap and len(self.tail) < self.reserved_tail

    def gate(self, req: SchedRequest, *, group: int, aged: bool, best_group: Callable[[], int]) -> SlotKind | Blocked:
        """How ``req`` would enter the batch, or why it cannot now. ``group``: waiting requests
        for its adapter (1: a single, tail-eligible); ``aged``: it has waited past the age
        deadline (it may open any slot, and take the claim); ``best_group()``: the largest
        waiting group of a ready adapter outside the batch, asked only for the last slot."""
        adapter = req.adapter
        if adapter is None:
            return SlotKind.BASE
        if adapter in self.running:
            return Blocked.ADAPTER if adapter in self.tail or adapter == self.draining else SlotKind.JOIN
        may_take_tail = group == 1 or aged
        free = self.free_general()
        claimed = self.claim is not None and self.claim is not req  # the next general slot is owed
        if not claimed and (free >= 2 or (free == 1 and (aged or group >= best_group()))):
            return SlotKind.GENERAL
        if may_take_tail and self.free_tail():
            return SlotKind.TAIL
        if aged and self.claim is None:
            self.claim = req
            # Rotate through the general holders: the one that opened its slot first drains.
            self.draining = next((a for a in self.running if a not in self.tail), None)
        return Blocked.ANY if may_take_tail else Blocked.GENERAL

    def occupy(self, req: SchedRequest, kind: SlotKind) -> None:
        adapter = req.adapter
        if adapter is None:
            return
        self.running[adapter] = self.running.get(adapter, 0) + 1
        if kind is SlotKind.TAIL:
            self.tail.add(adapter)
        elif kind is SlotKind.GENERAL:
            self.changed.append(adapter)  # its other waiting requests may join now

    def release(self, adapter: str | None) -> None:
        """A running request of ``adapter`` finished or was preempted."""
        if adapter is None:
            return
        left = self.running[adapter] - 1
        if left:
            self.running[adapter] = left
            return
        del self.running[adapter]
        self.tail.discard(adapter)
        if self.draining == adapter:
            self.draining = None
        self.changed.append(adapter)

    def unclaim(self, req: SchedRequest) -> None:
        """``req`` got in, left the queue or is loading again: its claim (if any) lapses."""
        if self.claim is req:
            self.claim = None
            if self.draining is not None:
                self.changed.append(self.draining)
                self.draining = None

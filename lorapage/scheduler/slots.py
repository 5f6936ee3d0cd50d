"""Distinct-adapter slots of the running batch: the cap, the reserved tail, the age deadline.

Decode cost grows with the number of distinct adapters in a step, so the batch holds at most
``cap`` of them. A request whose adapter is already in the batch *joins* it for free; one that
needs a new adapter *opens* a slot. ``tail`` of the ``cap`` slots are reserved for adapters with a
single queued request, and an adapter that came in through a tail slot takes no joins, so tail
slots keep turning over instead of being captured by hot adapters. A request older than the age
deadline that finds no slot *claims* the next one: nobody else opens a slot until it is in, and
the general holder that opened its slot first takes no joins until it drains, so hot
adapters rotate through the general slots instead of keeping them forever.
"""

from __future__ import annotations

from enum import Enum

from lorapage.scheduler.base import SchedRequest


class SlotKind(Enum):
    BASE = "base"  # no adapter: needs no slot
    JOIN = "join"  # its adapter is already in the batch
    GENERAL = "general"  # opens one of the cap - tail general slots
    TAIL = "tail"  # opens one of the reserved tail slots


class AdapterSlots:
    """Which adapters the running batch holds, and whether one more request may be admitted."""

    def __init__(self, cap: int, tail: int) -> None:
        self.cap = cap
        self.reserved_tail = tail
        self.running: dict[str, int] = {}  # adapter -> running requests using it, in opening order
        self.tail: set[str] = set()  # holders that opened a tail slot; they take no joins
        self.claim: SchedRequest | None = None  # an aged request owed the next slot that frees
        self.draining: str | None = None  # holder taking no joins so that the claim gets a slot

    def distinct(self) -> int:
        return len(self.running)

    def gate(self, req: SchedRequest, *, single: bool, aged: bool) -> SlotKind | None:
        """How ``req`` would enter the batch, or None when its adapter cannot join or open a
        slot now. ``single``: it is its adapter's only waiting request; ``aged``: it has waited
        past the age deadline (it may then register the claim)."""
        adapter = req.adapter
        if adapter is None:
            return SlotKind.BASE
        if adapter in self.running:
            return None if adapter in self.tail or adapter == self.draining else SlotKind.JOIN
        if self.claim is not None and self.claim is not req:
            return None
        used = len(self.running)
        if used - len(self.tail) < self.cap - self.reserved_tail and used < self.cap:
            return SlotKind.GENERAL
        if used < self.cap and (single or aged):
            return SlotKind.TAIL
        if aged and self.claim is None:
            self.claim = req
            # Tail holders drain by themselves; make a general slot free too, rotating through
            # them: the holder that opened its slot first (``running`` keeps opening order).
            self.draining = next((a for a in self.running if a not in self.tail), None)
        return None

    def occupy(self, req: SchedRequest, kind: SlotKind) -> None:
        adapter = req.adapter
        if adapter is None:
            return
        self.running[adapter] = self.running.get(adapter, 0) + 1
        if kind is SlotKind.TAIL:
            self.tail.add(adapter)

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

    def unclaim(self, req: SchedRequest) -> None:
        """``req`` got in, left the queue or is loading again: its claim (if any) lapses."""
        if self.claim is req:
            self.claim = None
            self.draining = None

"""Distinct-adapter lanes of the running batch: the cap, the reserved tail, the age deadline.

A *lane* is one distinct adapter's place in the running batch (not a lora slot, the adapter's row
in the device lookup tables). Decode cost grows with the number of distinct adapters in a step,
so the batch holds at most ``cap`` lanes. A request whose adapter is already in the batch *joins*
its lane for free; one that needs a new adapter *opens* a lane. While two or more general lanes
are free anyone may open one; the last one goes to the adapter with the most waiting requests
(biggest groups first, so lanes fill rows). ``tail`` of the ``cap`` lanes are reserved for
adapters with a single queued request, and an adapter that came in through a tail lane takes no
joins, so tail lanes keep turning over instead of being captured by hot adapters. A request older
than the age deadline that finds no lane *claims* the next general one: nobody else opens a
general lane until it is in, and the general holder that opened its lane first is *closing*: it
takes no joins until its rows finish and the lane frees, so hot adapters rotate through the
general lanes instead of keeping them forever. Tail lanes stay open to single requests meanwhile.

Lanes are *work-conserving*: a reservation nobody can use is lent. While no waiting request could
take a tail lane (none is a single-request adapter outside the batch or aged, ``wanting`` is
empty), the tail lanes count as general lanes, and tail holders take joins like general ones. Once
one appears, the lanes lent are owed back: no new general lane opens beyond ``cap - tail``, so the
next lane that frees is a tail lane, and the general holder whose rows finish soonest is closing
until it frees one (``recall``). A closing holder that nobody is owed a lane for takes joins again. A
request whose adapter is still loading goes on wanting (nothing is lent or recalled for it): lent
now, the lane would be held for a whole generation, and the load takes a moment. Lending and
recalling around every load was also what made a step cost more with many adapters.

Lanes come back within a bound (``lend_max_tokens``, default 16 decode steps): while nobody wants
a tail lane, lending is free (any request opens or joins a lent lane: no row is lost in steady
state). Once a request wants one and none is free, the holder whose lane is to free is chosen:
the general holder whose rows finish soonest (fewest output tokens left) is recalled while tail
lanes are lent, else the tail holder whose rows finish soonest; if its rows still run
``lend_max_tokens`` steps later they are *reclaimed*: the policy hands them to the engine to
preempt (they wait again and recompute, their tokens kept), so the lane frees. A tail request's
wait for a lane is then at most that many steps (plus its load and prefill), however long the
other generations are; without the bound (``None`` or 0) it waits for a holder's whole
generation (500 tokens at 50 ms: 25 s). 16 steps at the design's 50 ms are 0.8 s, inside its
p95 TTFT of 1 s warm and 2 s cold with the prefill and a load on top.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from enum import IntEnum

from lorapage.scheduler.base import SchedRequest


class LaneKind(IntEnum):
    """How an admissible request enters the batch (IntEnum: hashed in C, on every step's hot path)."""

    BASE = 0  # no adapter: needs no lane
    JOIN = 1  # its adapter's lane is already in the batch
    GENERAL = 2  # opens one of the cap - tail general lanes (or a tail lane lent)
    TAIL = 3  # opens one of the reserved tail lanes


class Blocked(IntEnum):
    """Why a ready request cannot enter now, which says what event could let it in."""

    ADAPTER = 0  # its adapter is in the batch but takes no joins (a tail or closing lane)
    GENERAL = 1  # it must open a general lane and none is free (to a group its size)
    ANY = 2  # it may open any lane (single request or aged) but none is free, or it is claimed


class AdapterLanes:
    """Which adapters the running batch holds, and whether one more request may be admitted."""

    def __init__(
        self,
        cap: int,
        tail: int,
        lend_max_tokens: int | None = None,
        tokens_left: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.cap = cap
        self.reserved_tail = tail
        self.lend_max_tokens = lend_max_tokens or None
        # Most output tokens any running row of each holder has left (whom a recall closes first);
        # None: the holder that opened first.
        self.tokens_left = tokens_left
        self.reclaiming: str | None = None  # the holder whose rows are preempted in reclaim_in steps
        self.reclaim_in = 0
        self.running: dict[str, int] = {}  # adapter -> running requests using it, in opening order
        self.tail: set[str] = set()  # holders that opened a tail lane; they take no joins until lent
        self.claim: SchedRequest | None = None  # an aged request owed the next lane that frees
        self.closing: str | None = None  # holder taking no joins so that a lane frees (claim, recall)
        self.changed: list[str] = []  # adapters that opened, closed or stopped closing (to wake waiters)
        # Requests that may open any lane (single-request adapter, or aged) and may be waiting for
        # one, oldest first: while any does, the tail lanes are reserved. Entries go stale (the
        # request's group grew, its adapter entered the batch); the policy drops stale ones from
        # the front before each step, and :meth:`unclaim` drops a request that got in or left.
        self.wanting: OrderedDict[str, SchedRequest] = OrderedDict()

    def distinct(self) -> int:
        return len(self.running)

    def free_general(self) -> int:
        """General lanes free (0 when the cap is reached); every free lane while nobody is
        ``wanting`` a tail lane (they are lent)."""
        used = len(self.running)
        if not self.wanting:
            return self.cap - used
        return max(0, min(self.cap - used, self.cap - self.reserved_tail - (used - len(self.tail))))

    def borrowed(self) -> int:
        """Tail lanes general holders occupy: lent while nobody wanted them."""
        return max(0, len(self.running) - len(self.tail) - (self.cap - self.reserved_tail))

    def tail_use(self) -> tuple[int, int]:
        """The reserved tail lanes in use: (held by adapters that came in through one, lent to
        general holders)."""
        return len(self.tail), self.borrowed()

    def free_tail(self) -> bool:
        return len(self.running) < self.cap and len(self.tail) < self.reserved_tail

    def gate(self, req: SchedRequest, *, group: int, aged: bool, best_group: Callable[[], int]) -> LaneKind | Blocked:
        """How ``req`` would enter the batch, or why it cannot now. ``group``: waiting requests
        for its adapter (1: a single, tail-eligible); ``aged``: it has waited past the age
        deadline (it may open any lane, and take the claim); ``best_group()``: the largest
        waiting group of a ready adapter outside the batch, asked only for the last lane."""
        adapter = req.adapter
        if adapter is None:
            return LaneKind.BASE
        if adapter in self.running:
            closed = adapter in self.tail or adapter == self.closing
            return Blocked.ADAPTER if closed else LaneKind.JOIN
        may_take_tail = group == 1 or aged
        free = self.free_general()
        claimed = self.claim is not None and self.claim is not req  # the next general lane is owed
        opens = not claimed and (free >= 2 or (free == 1 and (aged or group >= best_group())))
        if opens:
            return LaneKind.GENERAL
        if may_take_tail and self.free_tail():
            return LaneKind.TAIL
        if may_take_tail:
            self.want(req)
            self.recall()
        if aged and self.claim is None:
            self.claim = req
            self._close_oldest()
        return Blocked.ANY if may_take_tail else Blocked.GENERAL

    def want(self, req: SchedRequest) -> None:
        """``req`` may open any lane and may be waiting for one: the tail lanes are reserved."""
        self.wanting[req.request_id] = req

    def unwant(self, req: SchedRequest) -> None:
        """``req`` wants no tail lane now (its adapter has more waiting requests); a claim stays."""
        if req is not self.claim:
            self.wanting.pop(req.request_id, None)

    def recall(self) -> None:
        """A request is ``wanting`` a lane and none is free to it. While tail lanes are lent, the
        general holder whose rows finish soonest closes, so a lane (now a tail lane) frees within
        its generation. With the bound, the holder whose lane is to free (that one, or while no
        lane is lent the tail holder whose rows finish soonest) is reclaimed in
        ``lend_max_tokens`` steps if its rows still run then (:meth:`reclaim`)."""
        if self.free_tail():
            return
        if self.borrowed():
            if self.closing is None:  # else: one already closes
                self.closing = self._soonest([a for a in self.running if a not in self.tail])
            target = self.closing
        elif self.lend_max_tokens is not None and self.reclaiming is None:
            # Every tail lane held by a tail holder (which takes no joins): one long row could keep it.
            target = self._soonest([a for a in self.running if a in self.tail])
        else:
            return
        if self.lend_max_tokens is not None and self.reclaiming is None and target is not None:
            self.reclaiming, self.reclaim_in = target, self.lend_max_tokens

    def _soonest(self, holders: list[str]) -> str | None:
        """The one of ``holders`` whose rows finish soonest (fewest output tokens left), the first
        among equals; the first without ``tokens_left``."""
        if holders and self.tokens_left is not None:
            left = self.tokens_left()
            return min(holders, key=lambda a: left.get(a, 0))
        return holders[0] if holders else None

    def reclaim(self) -> str | None:
        """Once a step, before admissions: the holder whose running rows are to be preempted now
        (the bound ran out while a request still wants a lane), or None."""
        target = self.reclaiming
        if target is None:
            return None
        if target not in self.running or not self.wanting:
            self.reclaiming = None
            return None
        self.reclaim_in -= 1
        if self.reclaim_in > 0:
            return None
        self.reclaiming = None
        return target

    def lend(self) -> None:
        """Nobody is ``wanting`` a lane: tail holders take joins like general ones, and a closing
        holder that nobody is owed a lane for any more takes joins again."""
        self.reclaiming = None
        if self.tail:
            self.changed += self.tail
            self.tail.clear()
        if self.closing is not None and self.claim is None:
            self.changed.append(self.closing)
            self.closing = None

    def _close_oldest(self) -> None:
        """Rotate through the general holders: the one that opened its lane first closes."""
        if self.closing is None:
            self.closing = next((a for a in self.running if a not in self.tail), None)

    def occupy(self, req: SchedRequest, kind: LaneKind) -> None:
        adapter = req.adapter
        if adapter is None:
            return
        self.running[adapter] = self.running.get(adapter, 0) + 1
        if kind is LaneKind.TAIL:
            self.tail.add(adapter)
        elif kind is LaneKind.GENERAL:
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
        if self.reclaiming == adapter:  # its lane freed on its own
            self.reclaiming = None
        if self.closing == adapter:
            self.closing = None
        self.changed.append(adapter)

    def loading(self, req: SchedRequest) -> None:
        """``req``'s adapter is loading: its claim lapses, so the lane goes to someone who can use
        it now, but it still wants a tail lane (the reservation is not lent from under a load)."""
        if self.claim is req:
            self.claim = None

    def unclaim(self, req: SchedRequest) -> None:
        """``req`` got in, left the queue or needs no lane: its claim (if any) lapses and it no
        longer wants a lane (one whose adapter is loading again: :meth:`loading`).

        The closing holder goes on closing: only :meth:`lend`, before a step in which nobody is
        ``wanting`` a lane, reopens it. Reopening it here would wake its whole waiting group only
        for the next aged request to close it again at once: under a backlog of aged requests that
        cycle ran every step and made each step cost grow with the backlog
        (``bench/bench_scheduler.py --long``)."""
        self.wanting.pop(req.request_id, None)
        if self.claim is req:
            self.claim = None

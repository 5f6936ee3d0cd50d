"""One registered version's residency state, and the pool as the residency rules see it (no torch).

:class:`Residence` is the record every part of the residency rules works on
(:mod:`lorapage.adapters.residency`): where a version is, who uses it, and how its load stands.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from lorapage.adapters.value import LoadTier
from lorapage.errors import AdapterNotFoundError
from lorapage.memory.pages import PageKind
from lorapage.memory.reclaim import RATE_HALF_LIFE_S


class Phase(Enum):
    """Where a version's load stands."""

    COLD = "cold"  # not in the pool, no load
    READING = "reading"  # a load is bringing its packed copy into host RAM
    PLACING = "placing"  # its packed copy is in hand: waiting for a lora slot and pages
    COPYING = "copying"  # slot and pages reserved, its copy into them in flight
    RESIDENT = "resident"  # in the pool


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
    # Its first admission since it last became resident: its turn, at least adapter_wait_s before
    # it may be made to yield, runs from here (None: not started, or a preemption left nothing
    # running on it). A version loaded for a queued request whose admission waits on KV room, or
    # whose request was preempted for it, keeps its slot until it serves.
    turn_since: float | None = None
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

    @property
    def idle(self) -> bool:
        """Nothing runs on it or waits for it, and nothing holds it: evictable by value."""
        return self.running == 0 and self.waiting == 0 and not self.pinned and not self.hot


def lookup(versions: Mapping[str, Residence], key: str) -> Residence:
    """``key``'s record; an unknown version is a 404."""
    try:
        return versions[key]
    except KeyError:
        raise AdapterNotFoundError(f"adapter {key!r} does not exist", param="model") from None


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

"""How much of the pool admin pins may hold, and which versions pins and hot traffic hold (no torch).

A pin keeps one version resident whatever its traffic (``PUT /v1/adapters/{id}/pin``). Pins are
bounded so that the pool keeps serving everything else:

    pinned pages + asked <= min(floor(max_pinned_fraction x pool pages),
                                pool pages - one full-length sequence - the largest adapter allowed)
    pinned adapters      <= max_resident_loras - 1

The versions the traffic tiers keep resident for being hot (:meth:`Residency.set_hot`) count
with the admin pins against these same bounds, but only in the room the admin pins leave: an
admin pin is checked against the admin pins alone, and hot versions are let go to make room.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lorapage.adapters.residence import Phase, Residence, lookup
from lorapage.errors import ConflictError, PinLimitError


@dataclass(frozen=True)
class PinBounds:
    """The pool's sizes the pin bounds are computed from."""

    capacity: int  # pool pages that can be handed out
    max_resident_loras: int  # lora slots
    max_pinned_fraction: float = 0.5
    sequence_pages: int = 0  # KV pages of one full-length sequence
    max_adapter_pages: int = 0  # pages of the largest adapter allowed (max_lora_rank on every module)

    def limit(self) -> int:
        """Pages pins may hold together: ``max_pinned_fraction`` of the pool, and never so many
        that one full-length sequence beside the largest adapter allowed no longer fits in the
        rest (requests could then wait forever for pages no one gives back)."""
        room = self.capacity - self.sequence_pages - self.max_adapter_pages
        return max(0, min(math.floor(self.max_pinned_fraction * self.capacity), room))

    def within(self, held: int, pinned: int) -> bool:
        """Whether ``pinned`` adapters holding ``held`` pages are inside the bounds."""
        return held <= self.limit() and pinned < self.max_resident_loras

    def fits(self, asked: int, held: int, pinned: int) -> bool:
        """Whether one more adapter of ``asked`` pages fits beside ``pinned`` holding ``held``."""
        return self.within(held + asked, pinned + 1)

    def check(self, key: str, asked: int, held: int, pinned: int) -> None:
        """Refuse (:class:`~lorapage.errors.PinLimitError`, 409) pinning ``key`` (``asked``
        pages) while pins hold ``held`` pages over ``pinned`` adapters, past the bounds."""
        limit = self.limit()
        if held + asked > limit:
            raise PinLimitError(
                f"pinning {key} asks for {asked} pages; pins hold {held} pages and may hold {limit} of the "
                f"pool's {self.capacity} (max_pinned_fraction {self.max_pinned_fraction:g} of the pool, leaving room "
                f"for one full-length sequence of {self.sequence_pages} pages beside the largest adapter, "
                f"{self.max_adapter_pages} pages); unpin an adapter or raise --max-pinned-fraction",
                param="id",
            )
        if pinned + 1 >= self.max_resident_loras:
            raise PinLimitError(
                f"pinning {key} would leave no unpinned lora slot: {pinned} of the {self.max_resident_loras} "
                "slots (--max-resident-loras) are pinned and one must stay free for every other adapter; unpin an "
                "adapter or raise --max-resident-loras",
                param="id",
            )


class Pins:
    """Which versions are held resident whatever their value: the admin pins, and the traffic
    tiers' hot versions in the room the admin pins leave within the :class:`PinBounds`
    (``bounds`` None: pins refused). The flags live on each version's
    :class:`~lorapage.adapters.residence.Residence`; this holds the rules that set them."""

    def __init__(self, bounds: PinBounds | None, versions: Mapping[str, Residence]) -> None:
        self.bounds, self._versions = bounds, versions
        self._hot_order: list[str] = []  # the traffic tiers' hot versions, most requested first (set_hot)

    def limit(self) -> int:
        """Pool pages pins may hold together (0: pins refused)."""
        return self.bounds.limit() if self.bounds is not None else 0

    def pinned(self) -> list[str]:
        return [r.key for r in self._versions.values() if r.pinned]

    def pinned_pages(self) -> int:
        """Pool pages the pinned versions take (loaded or not yet)."""
        return sum(r.pages for r in self._versions.values() if r.pinned)

    def hot(self) -> list[str]:
        """Versions kept resident for their traffic (:meth:`set_hot`), most requested first."""
        return [k for k in self._hot_order if (r := self._versions.get(k)) is not None and r.hot]

    def to_load(self) -> list[str]:
        """Pinned versions not resident (their loads start when the engine restores its pins)."""
        return [r.key for r in self._versions.values() if r.pinned and r.phase is not Phase.RESIDENT]

    def check(self, key: str) -> None:
        """Refuse (:class:`~lorapage.errors.PinLimitError`, 409) pinning ``key`` past the bounds."""
        r = lookup(self._versions, key)
        if r.pinned:
            return
        if self.bounds is None:
            raise ConflictError("pins are not enabled here", param="id")
        pinned = sum(1 for x in self._versions.values() if x.pinned)
        self.bounds.check(key, r.pages, self.pinned_pages(), pinned)

    def pin(self, key: str) -> Residence:
        """An admin pins ``key`` (checked against the bounds): hot versions are let go, least
        requested first, until admin pins and hot ones together are inside the bounds again (an
        admin pin never waits for a hot one)."""
        self.check(key)
        pinned = self._versions[key]
        pinned.pinned = True
        if self.bounds is None:
            return pinned
        kept = [self._versions[k] for k in self.hot()]
        pages = self.pinned_pages() + sum(r.pages for r in kept if not r.pinned)
        count = len(self.pinned()) + sum(1 for r in kept if not r.pinned)
        while kept and not self.bounds.within(pages, count):
            r = kept.pop()
            r.hot = False
            if not r.pinned:
                pages, count = pages - r.pages, count - 1
        return pinned

    def set_hot(self, keys: list[str]) -> list[Residence]:
        """The hot versions, most requested first: each one the bounds still have room for beside
        the admin pins (and the hot ones before it) is kept resident as a pin is; any other
        version, hot no more or past the bounds, is evictable by value again. The versions kept
        hot, in that order."""
        self._hot_order = [k for k in keys if k in self._versions]
        for r in self._versions.values():
            r.hot = False
        pages, count = self.pinned_pages(), len(self.pinned())
        kept: list[Residence] = []
        for key in self._hot_order:
            r = self._versions[key]
            if r.pinned or self.bounds is None or not self.bounds.fits(r.pages, pages, count):
                continue  # an admin pin holds it already, or no room is left for it
            r.hot = True
            pages, count = pages + r.pages, count + 1
            kept.append(r)
        return kept

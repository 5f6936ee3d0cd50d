"""How much of the pool admin pins may hold (no torch).

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
from dataclasses import dataclass

from lorapage.errors import PinLimitError


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

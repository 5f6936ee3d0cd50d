"""The host-RAM tier: which versions have a packed copy in host RAM, an LRU bounded by count and bytes (no torch).

A version's packed copy is what a load copies into the pool; keeping it means the next load of
that version reads no files. The LRU holds at most ``max_cpu_loras`` copies and, when given,
``max_cpu_lora_bytes`` bytes; the least recently used leave first. The engine's
:class:`~lorapage.adapters.cache.AdapterCache` holds the tensors; this holds the rule.
"""

from __future__ import annotations

from collections import OrderedDict

from lorapage.adapters.decisions import DropHost
from lorapage.adapters.residence import Residence
from lorapage.adapters.value import LoadTier


class HostRam:
    """Versions with a packed copy in host RAM, least recently used first, and their bytes."""

    def __init__(self, max_copies: int, max_bytes: int | None = None) -> None:
        self.max_copies, self.max_bytes = max_copies, max_bytes
        self._copies: OrderedDict[str, int] = OrderedDict()  # version -> bytes of its packed copy, LRU first
        self.nbytes = 0  # their sum

    def __contains__(self, key: str) -> bool:
        return key in self._copies

    def keys(self) -> list[str]:
        """Versions with a packed copy in host RAM, least recently used first."""
        return list(self._copies)

    def falls_to(self, r: Residence) -> LoadTier:
        """Where a load of ``r`` would start now (for a resident version: where it would fall to
        if evicted; its host copy stays)."""
        return LoadTier.RAM if r.key in self._copies else r.cold

    def keep(self, key: str, size: int) -> list[DropHost]:
        """``key``'s packed copy (``size`` bytes) is the most recently used; the least recently
        used copies leave while the LRU holds more than ``max_copies`` copies or more than
        ``max_bytes`` bytes. A copy larger than that bound alone leaves at once, and nothing else
        for it (its load still has the copy in hand)."""
        if self.max_bytes is not None and size > self.max_bytes:
            self.drop(key)
            return [DropHost(key)]
        if key not in self._copies:
            self._copies[key] = size
            self.nbytes += size
        self._copies.move_to_end(key)
        out: list[DropHost] = []
        while self._copies and (
            len(self._copies) > self.max_copies or (self.max_bytes is not None and self.nbytes > self.max_bytes)
        ):
            dropped, size = self._copies.popitem(last=False)
            self.nbytes -= size
            out.append(DropHost(dropped))
        return out

    def drop(self, key: str) -> bool:
        """``key``'s copy leaves (its version was removed); whether it was here."""
        if key not in self._copies:
            return False
        self.nbytes -= self._copies.pop(key)
        return True

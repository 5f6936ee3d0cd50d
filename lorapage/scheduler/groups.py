"""Waiting requests grouped by adapter, and the biggest group outside the batch."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container
from typing import Generic

from lorapage.scheduler.base import R
from lorapage.scheduler.tenant_queue import Waiting


class AdapterGroups(Generic[R]):
    """``adapter -> {request_id: entry}`` for waiting requests, with a lazy max-heap of group
    sizes: an entry ``(-size, adapter)`` is valid while the group still has that size and its
    adapter is outside the batch. Stale entries are dropped at the top, or all at once when the
    heap outgrows the groups."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, Waiting[R]]] = {}
        self._heap: list[tuple[int, str]] = []

    def size(self, adapter: str) -> int:
        return len(self.groups.get(adapter, ()))

    def heap_entries(self) -> int:
        """Entries in the size heap, stale ones included."""
        return len(self._heap)

    def entries(self, adapter: str) -> list[Waiting[R]]:
        return list(self.groups.get(adapter, {}).values())

    def add(self, entry: Waiting[R], in_batch: Container[str]) -> None:
        adapter = entry.req.adapter
        assert adapter is not None
        self.groups.setdefault(adapter, {})[entry.req.request_id] = entry
        self.push(adapter, in_batch)

    def remove(self, entry: Waiting[R], in_batch: Container[str]) -> None:
        adapter = entry.req.adapter
        assert adapter is not None
        group = self.groups[adapter]
        del group[entry.req.request_id]
        if group:
            self.push(adapter, in_batch)
        else:
            del self.groups[adapter]

    def push(self, adapter: str, in_batch: Container[str]) -> None:
        """Record ``adapter``'s current size (it changed, or it left the batch)."""
        group = self.groups.get(adapter)
        if group and adapter not in in_batch:
            heapq.heappush(self._heap, (-len(group), adapter))
            if len(self._heap) > 4 * len(self.groups) + 64:  # mostly stale: rebuild
                self._heap = [(-len(g), a) for a, g in self.groups.items() if a not in in_batch]
                heapq.heapify(self._heap)

    def biggest(self, in_batch: Container[str], ready: Callable[[Waiting[R]], bool]) -> str | None:
        """The ready adapter outside the batch with the most waiting requests."""
        heap = self._heap
        loading: list[tuple[int, str]] = []
        best = None
        while heap:
            size, adapter = heap[0]
            group = self.groups.get(adapter)
            if not group or len(group) != -size or adapter in in_batch:
                heapq.heappop(heap)  # stale: a fresh entry is pushed whenever it matters again
            elif not ready(next(iter(group.values()))):
                loading.append(heapq.heappop(heap))
            else:
                best = adapter
                break
        for item in loading:
            heapq.heappush(heap, item)
        return best

"""Which adapters to read into host RAM ahead of their requests, and when (no torch, no clock).

A tenant's request queues a prefetch of the tenant's other recent adapters
(:class:`~lorapage.adapters.value.RecentAdapters`). A prefetch reads and packs into host RAM
only: it takes no lora slot and no page. The queue holds :data:`PREFETCH_QUEUE_LEN` (the oldest
is dropped); at most ``max_running`` run at once, at most :data:`PREFETCHES_PER_TENANT` of one
tenant's, so a slow one holds up only its own tenant. Whether one may start at all (no load is
reading files) is the residency rules' call (:mod:`lorapage.adapters.residency`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

PREFETCH_QUEUE_LEN = 16  # prefetches waiting to start beyond this drop the oldest
PREFETCHES_PER_TENANT = 1  # one tenant's prefetches running at once: a slow one holds only its own
PREFETCH_COUNTS = ("started", "done", "failed", "dropped")


class PrefetchQueue:
    """Prefetches waiting (in order, each with its tenant) and running, with their counts."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.waiting: OrderedDict[str, str] = OrderedDict()  # key -> tenant, oldest first
        self.running: dict[str, str] = {}  # key -> tenant
        self._per_tenant: Counter[str] = Counter()  # tenant -> its prefetches running
        self.counts: Counter[str] = Counter()  # started, done, failed, dropped (queue full)

    def offer(self, keys: Iterable[str], tenant: str) -> None:
        """Queue ``keys`` for ``tenant`` (those already queued keep their place)."""
        for key in keys:
            if key in self.waiting:
                continue
            self.waiting[key] = tenant
            if len(self.waiting) > PREFETCH_QUEUE_LEN:
                self.waiting.popitem(last=False)
                self.counts["dropped"] += 1

    def start(self, wanted: Callable[[str], bool]) -> list[tuple[str, str]]:
        """The queued prefetches to start now, oldest first among tenants below their share,
        as (key, tenant); those no longer ``wanted`` leave the queue unstarted."""
        started = []
        for key, tenant in list(self.waiting.items()):
            if len(self.running) >= self.max_running:
                break
            if self._per_tenant[tenant] >= PREFETCHES_PER_TENANT:
                continue  # behind its own tenant's prefetch, not anyone else's
            del self.waiting[key]
            if wanted(key):
                self.counts["started"] += 1
                self._per_tenant[tenant] += 1
                self.running[key] = tenant
                started.append((key, tenant))
        return started

    def done(self, key: str, ok: bool) -> None:
        """The running prefetch of ``key`` ended (read into host RAM, or failed)."""
        self._stop(key)
        self.counts["done" if ok else "failed"] += 1

    def forget(self, key: str) -> None:
        """``key`` was unregistered: out of the queue, and its running prefetch is cancelled."""
        self.waiting.pop(key, None)
        self._stop(key)

    def clear(self) -> None:
        """Nothing is queued or running any more (the reads died with their event loop)."""
        self.waiting.clear()
        self.running.clear()
        self._per_tenant.clear()

    def _stop(self, key: str) -> None:
        tenant = self.running.pop(key, None)
        if tenant is not None:
            self._per_tenant[tenant] -= 1
            if not self._per_tenant[tenant]:
                del self._per_tenant[tenant]

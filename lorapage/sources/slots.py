"""Per-tenant shares of the downloads: at most ``per_tenant`` of one tenant's run at once.

Its other downloads wait in its own line, so a tenant whose sources are slow (or hostile) holds
only its own share, and another tenant's download starts at once. Used on the event loop only.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable


class TenantSlots:
    """One semaphore per tenant with downloads running or waiting (forgotten once it has none)."""

    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self._semaphores: dict[str, asyncio.Semaphore] = {}
        self._users: Counter[str] = Counter()  # per tenant: downloads holding or waiting for a slot
        self._running: Counter[str] = Counter()  # per tenant: downloads holding a slot

    async def acquire(self, tenant: str) -> Callable[[], None]:
        """Wait for one of ``tenant``'s slots; returns the call that gives it back (idempotent)."""
        semaphore = self._semaphores.setdefault(tenant, asyncio.Semaphore(self.per_tenant))
        self._users[tenant] += 1
        try:
            await semaphore.acquire()
        except BaseException:
            self._leave(tenant)
            raise
        self._running[tenant] += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._running[tenant] -= 1
                semaphore.release()
                self._leave(tenant)

        return release

    def running(self, tenant: str) -> int:
        """``tenant``'s downloads holding a slot now."""
        return self._running[tenant]

    def _leave(self, tenant: str) -> None:
        self._users[tenant] -= 1
        if not self._users[tenant]:
            del self._users[tenant], self._semaphores[tenant]
            self._running.pop(tenant, None)

"""Worker threads shared by every tenant, taken in turn: one FIFO per tenant, round robin.

Prompt work (decoding a big body, rendering a chat template, tokenizing) runs in a few threads.
With one shared FIFO, a tenant that queued six multi-megabyte prompts held every other tenant's
tiny request behind them for most of a minute. Here each tenant has its own queue and the
threads serve the tenants with work in turn, one unit each; a tenant may hold at most
``per_tenant`` threads at once (one fewer than there are, by default), so a thread is always
left for the others. Callers cut long work into units (a prompt is tokenized chunk by chunk),
so a tenant's turn is short.

How many units a tenant can queue is bounded by its admission: each request it has in flight
waits for at most one unit at a time.

A unit given a deadline (:meth:`FairWorkers.run`'s ``deadline_s``: a grammar compile) that
passes it fails its caller with TimeoutError; a Python thread cannot be stopped, so if it is
running it goes on, counted against its own tenant's share until it ends, and a spare thread
(at most ``max_spare`` at once) serves the others meanwhile: an overrun costs its tenant, not
everyone.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Generic, TypeVar

T = TypeVar("T")
Item = TypeVar("Item")


class FairQueue(Generic[Item]):
    """Items queued per tenant, taken round robin among the tenants below ``per_tenant`` items
    taken and not yet :meth:`done`. Pure: no threads, no clock."""

    def __init__(self, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant must be >= 1; got {per_tenant}")
        self.per_tenant = per_tenant
        self._queues: dict[str, deque[Item]] = {}  # tenant -> its items, oldest first (only tenants with some)
        self._turns: deque[str] = deque()  # tenants with queued items, whose turn comes first first
        self._taken: dict[str, int] = {}  # tenant -> items taken and not done yet

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def push(self, tenant: str, item: Item) -> None:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
            self._turns.append(tenant)
        queue.append(item)

    def pop(self) -> tuple[str, Item] | None:
        """The next tenant's oldest item (that tenant's turn moves to the back), or None when no
        tenant with queued items may take one more."""
        for _ in range(len(self._turns)):
            tenant = self._turns.popleft()
            if self._taken.get(tenant, 0) >= self.per_tenant:
                self._turns.append(tenant)
                continue
            queue = self._queues[tenant]
            item = queue.popleft()
            if queue:
                self._turns.append(tenant)
            else:
                del self._queues[tenant]
            self._taken[tenant] = self._taken.get(tenant, 0) + 1
            return tenant, item
        return None

    def done(self, tenant: str) -> None:
        """An item :meth:`pop` gave for ``tenant`` is finished."""
        left = self._taken[tenant] - 1
        if left:
            self._taken[tenant] = left
        else:
            del self._taken[tenant]

    def drain(self) -> list[Item]:
        """Every queued item, removed."""
        items = [item for queue in self._queues.values() for item in queue]
        self._queues.clear()
        self._turns.clear()
        return items


class FairWorkers:
    """``threads`` worker threads over a :class:`FairQueue`; :meth:`run` awaits one unit of work."""

    def __init__(self, threads: int, *, name: str, per_tenant: int | None = None, max_spare: int = 0) -> None:
        self._queue: FairQueue[tuple[Future, Callable[[], object]]] = FairQueue(per_tenant or max(1, threads - 1))
        self._cond = threading.Condition()
        self._closed = False
        self._name, self._started = name, 0
        self._max_spare = max_spare
        self.spares = 0  # spare threads covering units past their deadline
        self._retiring = 0  # threads to stop after their unit: an overrun they covered has ended
        for _ in range(threads):
            self._start_thread()

    def _start_thread(self) -> None:
        threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()
        self._started += 1

    async def run(self, tenant: str, fn: Callable[..., T], *args: object, deadline_s: float | None = None) -> T:
        """``fn(*args)`` on a worker thread, in ``tenant``'s turn. Cancelling the caller drops the
        unit if it has not started. Past ``deadline_s`` (waiting included): TimeoutError, and a
        unit that is running is covered by a spare thread until it ends."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the workers are closed")
            self._queue.push(tenant, (future, partial(fn, *args)))
            self._cond.notify()
        if deadline_s is None:
            return await asyncio.wrap_future(future)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), deadline_s)
        except TimeoutError:
            if not future.cancel():  # running: its thread is lost to the others until it ends
                self._cover(future)
            raise

    def _cover(self, future: Future) -> None:
        with self._cond:
            if self._closed or self.spares >= self._max_spare:
                return
            self.spares += 1
            self._start_thread()
        future.add_done_callback(self._uncover)

    def _uncover(self, _: Future) -> None:
        with self._cond:
            self.spares -= 1
            self._retiring += 1  # the next thread to look for work stops: as many threads as before
            self._cond.notify()

    def close(self) -> None:
        """Stop the threads once their current unit ends; queued units are cancelled."""
        with self._cond:
            self._closed = True
            for future, _ in self._queue.drain():
                future.cancel()
            self._cond.notify_all()

    def _next(self) -> tuple[str, tuple[Future, Callable[[], object]]] | None:
        with self._cond:
            while not self._closed:
                if self._retiring:
                    self._retiring -= 1
                    return None
                got = self._queue.pop()
                if got is not None:
                    return got
                self._cond.wait()
            return None

    def _work(self) -> None:
        while (got := self._next()) is not None:
            tenant, (future, call) = got
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(call())
                    except BaseException as exc:  # the caller gets it, as from an executor
                        future.set_exception(exc)
            finally:
                with self._cond:
                    self._queue.done(tenant)
                    self._cond.notify()

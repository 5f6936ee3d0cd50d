"""The prompt threads' queue: one FIFO per tenant, taken round robin, a tenant below its cap."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lorapage.fair_workers import FairQueue, FairWorkers
from lorapage.frontend.prompts import chunks


def test_tenants_are_served_in_turn_whatever_their_backlog():
    queue: FairQueue[str] = FairQueue(per_tenant=10)
    for i in range(6):
        queue.push("hog", f"hog-{i}")
    queue.push("a", "a-0")
    queue.push("b", "b-0")
    queue.push("a", "a-1")
    order = []
    while (got := queue.pop()) is not None:
        tenant, item = got
        order.append(item)
        queue.done(tenant)
    assert order == ["hog-0", "a-0", "b-0", "hog-1", "a-1", "hog-2", "hog-3", "hog-4", "hog-5"]
    assert len(queue) == 0


def test_a_tenant_holds_at_most_its_cap_and_the_rest_wait_their_turn():
    queue: FairQueue[str] = FairQueue(per_tenant=1)
    for i in range(3):
        queue.push("hog", f"hog-{i}")
    assert queue.pop() == ("hog", "hog-0")
    assert queue.pop() is None  # the hog's next waits for its first to be done
    queue.push("victim", "v")
    assert queue.pop() == ("victim", "v")  # the other thread goes to the victim
    queue.done("hog")
    assert queue.pop() == ("hog", "hog-1")
    assert sorted(queue.drain()) == ["hog-2"] and queue.pop() is None
    with pytest.raises(ValueError):
        FairQueue(per_tenant=0)


async def test_workers_run_units_in_threads_and_drop_cancelled_ones():
    workers = FairWorkers(2, name="test-fair")
    release = threading.Event()
    ran: list[str] = []
    try:
        assert await workers.run("a", lambda x: x * 2, 21) == 42
        blocker = asyncio.ensure_future(workers.run("a", release.wait))  # holds the tenant's one thread
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(workers.run("a", ran.append, "queued"))  # waits: a holds its cap
        other = await workers.run("b", threading.current_thread)  # b gets the other thread meanwhile
        assert other.name.startswith("test-fair-")
        queued.cancel()
        # The cancel reaches the worker's future in a callback of the loop: let it run before the
        # blocker ends, or a worker freed by it may start the unit first.
        await asyncio.gather(queued, return_exceptions=True)
        release.set()
        assert await blocker is True
        assert await workers.run("a", lambda: "after") == "after"
        assert ran == []  # the cancelled unit never ran
        with pytest.raises(ZeroDivisionError):
            await workers.run("a", lambda: 1 / 0)
    finally:
        release.set()
        workers.close()
    with pytest.raises(RuntimeError):
        await workers.run("a", lambda: None)


def test_chunks_cover_the_text_and_end_after_a_space_when_they_can():
    text = ("word " * 50_000) + "x" * 200_000
    pieces = list(chunks(text, 65_536))
    assert "".join(pieces) == text
    assert all(len(p) <= 65_536 for p in pieces)
    assert all(p.endswith(" ") for p in pieces[:3])  # the words: cut after a space
    assert pieces[-1].endswith("x")

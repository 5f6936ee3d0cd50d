"""Closing the engine: what is in flight finishes, and the event loop keeps serving meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

from engine_util import collect, tiny_engine

from lorapage import SamplingParams


async def test_close_during_a_step_finishes_running_requests():
    """close() while a forward step is in flight must still end every caller's stream."""
    engine = tiny_engine()
    execute = engine.debug.runner.execute

    def slow_execute(plan):
        time.sleep(0.05)
        return execute(plan)

    engine.debug.runner.execute = slow_execute
    gen = engine.generate([5, 9, 12, 30], "acme", SamplingParams(max_tokens=200, ignore_eos=True))
    await gen.__anext__()

    async def drain():
        last = None
        async for last in gen:
            pass
        return last

    consumer = asyncio.ensure_future(drain())
    await asyncio.sleep(0.01)  # the next step is now running in the forward thread
    await engine.close()
    last = await asyncio.wait_for(consumer, 5)
    assert last.finished and last.finish_reason == "abort"


async def test_close_keeps_the_event_loop_serving_while_the_step_in_flight_finishes():
    """close() waits for the forward thread's step without blocking the event loop (an HTTP server
    on the same loop keeps answering meanwhile), and a second close() is harmless."""
    engine = tiny_engine()
    execute = engine.debug.runner.execute
    entered, gate = threading.Event(), threading.Event()

    def gated_execute(plan):
        entered.set()
        gate.wait(10)
        return execute(plan)

    engine.debug.runner.execute = gated_execute
    outputs = asyncio.ensure_future(
        collect(engine, [5, 9, 12, 30], "acme", SamplingParams(max_tokens=50, ignore_eos=True))
    )
    while not entered.is_set():
        await asyncio.sleep(0.005)
    closing = asyncio.ensure_future(engine.close())
    await asyncio.sleep(0.05)
    assert not closing.done(), "close() must wait for the step in flight"
    gate.set()  # this line runs only because close() left the loop free
    await asyncio.wait_for(closing, 10)
    last, _ = await asyncio.wait_for(outputs, 10)
    assert last.finished and last.finish_reason == "abort"
    await engine.close()

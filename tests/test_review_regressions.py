"""Regression tests for bugs found in review: hangs and leaks on close, adapter-load failure and
requests the pool could never hold together with their adapter; seeded sampling on a GPU."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from engine_util import collect, tiny_engine

from lorapage import SamplingParams
from lorapage.errors import AdapterLoadError, EngineStepError, PromptTooLongError
from lorapage.model.sampler import SampleRow, sample


async def test_close_during_a_step_finishes_running_requests():
    """close() while a forward step is in flight must still end every caller's stream."""
    engine = tiny_engine()
    execute = engine.runner.execute

    def slow_execute(plan):
        time.sleep(0.05)
        return execute(plan)

    engine.runner.execute = slow_execute
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
    execute = engine.runner.execute
    entered, gate = threading.Event(), threading.Event()

    def gated_execute(plan):
        entered.set()
        gate.wait(10)
        return execute(plan)

    engine.runner.execute = gated_execute
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


async def test_request_that_cannot_fit_beside_its_adapter_is_refused():
    """KV for prompt + max_tokens fits the pool, but not beside the request's own adapter: it
    could never be admitted (or would preempt itself forever), so it must be refused up front."""
    probe = tiny_engine()
    pages = probe.adapter_info("initech").num_pages
    engine = tiny_engine(num_pages=1 + pages + 3)
    with pytest.raises(PromptTooLongError):
        await asyncio.wait_for(collect(engine, [5, 9, 12, 30], "initech", SamplingParams(max_tokens=20)), 10)
    await engine.close()


async def test_adapter_copy_failure_returns_its_slot_and_pages():
    engine = tiny_engine(max_loras=2)
    free = engine.pool_free_pages()

    def broken_copy(*args):
        raise RuntimeError("device copy failed")

    real_copy = engine.adapters._copy_in
    engine.adapters._copy_in = broken_copy
    with pytest.raises(AdapterLoadError):
        await collect(engine, [5, 9, 12, 30], "acme", SamplingParams(max_tokens=4))
    assert engine.pool_free_pages() == free
    engine.adapters._copy_in = real_copy
    outs = await asyncio.gather(
        *(collect(engine, [5, 9, 12, 30], a, SamplingParams(max_tokens=4)) for a in ("acme", "globex"))
    )
    assert all(o.finish_reason == "length" for o, _ in outs)
    await engine.close()


async def test_adapter_removed_while_its_copy_is_queued_gives_back_slot_and_pages():
    """Unregistering an adapter whose copy waits on the busy forward thread must not leak its slot
    and pages, nor free them before the queued copy has run."""
    engine = tiny_engine(max_loras=2)
    free, slots = engine.pool_free_pages(), len(engine.adapters._free_slots)
    gate = threading.Event()
    engine._forward.submit(gate.wait, 10)  # the forward thread is busy: the copy queues behind it
    engine.adapters.ensure("acme")
    for _ in range(500):
        if engine.pool_free_pages() < free:
            break
        await asyncio.sleep(0.01)
    assert engine.pool_free_pages() < free, "the load should have reserved its pages"
    engine.remove_adapter("acme")
    await asyncio.sleep(0.05)
    assert engine.pool_free_pages() < free, "pages went back while their copy was still queued"
    gate.set()
    for _ in range(500):
        if engine.pool_free_pages() == free:
            break
        await asyncio.sleep(0.01)
    assert engine.pool_free_pages() == free and len(engine.adapters._free_slots) == slots
    outs = await asyncio.gather(
        *(collect(engine, [5, 9, 12, 30], a, SamplingParams(max_tokens=4)) for a in ("globex", "initech"))
    )
    assert all(o.finish_reason == "length" for o, _ in outs)
    await engine.close()


async def test_policy_failing_mid_schedule_leaks_nothing():
    """A scheduling policy that raises after admitting requests: those requests get the error,
    and their pages and adapter pins come back, so the engine serves the next request normally."""
    engine = tiny_engine()
    await engine.load_adapter("acme")
    free = engine.pool_free_pages()
    schedule = engine.policy.schedule

    def failing_schedule(now, ctx):
        if schedule(now, ctx):
            engine.policy.schedule = schedule
            raise RuntimeError("policy bug")
        return []

    engine.policy.schedule = failing_schedule
    with pytest.raises(EngineStepError, match="policy bug"):
        await collect(engine, [5, 9, 12, 30], "acme", SamplingParams(max_tokens=4))
    entry = engine.adapters.get("acme")
    assert (entry.running, entry.waiting) == (0, 0)
    assert engine.pool_free_pages() == free
    out, _ = await collect(engine, [5, 9, 12, 30], "acme", SamplingParams(max_tokens=4))
    assert out.finish_reason == "length"
    await engine.close()


async def test_cold_adapter_is_not_starved_by_hot_adapters_holding_every_slot():
    """Both slots belong to adapters that always have requests running and queued, so neither is
    ever idle enough to evict. A request for a third adapter must still be served: past
    ``adapter_wait_s`` its load drains one busy adapter and takes the slot, and the drained
    adapter's queued requests are served again afterwards."""
    engine = tiny_engine(max_loras=2, max_num_seqs=4, adapter_wait_s=0.05)
    stop = False
    served: dict[str, int] = {"acme": 0, "globex": 0}

    async def hot(adapter: str, max_tokens: int) -> None:
        while not stop:
            out, _ = await collect(
                engine, [5, 9, 12, 30], adapter, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
            assert out.finish_reason == "length"
            served[adapter] += 1

    workers = [asyncio.ensure_future(hot(a, n)) for a in ("acme", "globex") for n in (6, 9, 13)]
    while min(served.values()) < 2:
        await asyncio.sleep(0.01)
    cold, _ = await asyncio.wait_for(collect(engine, [5, 9, 12, 30], "initech", SamplingParams(max_tokens=4, temperature=0.0)), 30)
    assert cold.text == "Init"  # four byte tokens of "Initech TPS report filed."
    after = dict(served)
    while any(served[a] <= after[a] for a in served):  # both hot adapters are served again
        await asyncio.sleep(0.01)
    stop = True
    await asyncio.wait_for(asyncio.gather(*workers), 30)
    assert not any(e.yielding for e in engine.adapters.entries.values())
    assert engine.stats()["adapter_yields"] >= 1
    await engine.close()


async def test_starving_loads_take_turns_in_order():
    """One slot, three adapters that always have requests. Each starving load waits its turn in
    line, so every three consecutive residency turns hold all three adapters (before, two of
    them could swap the slot again and again while the third waited)."""
    engine = tiny_engine(max_loras=1, max_num_seqs=8, adapter_wait_s=0.05)
    await engine.load_adapter("acme")
    stop = False

    async def hot(adapter: str, max_tokens: int) -> None:
        while not stop:
            await collect(engine, [5, 9, 12, 30], adapter, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    workers = [asyncio.ensure_future(hot(a, n)) for a in ("acme", "globex", "initech") for n in (20, 31)]
    turns: list[str] = []
    for _ in range(3000):
        resident = engine.adapters.resident()
        if resident and (not turns or turns[-1] != resident[0]):
            turns.append(resident[0])
        if len(turns) >= 7:
            break
        await asyncio.sleep(0.002)
    stop = True
    await asyncio.wait_for(asyncio.gather(*workers), 30)
    await engine.close()
    assert len(turns) >= 7, turns
    for i in range(1, len(turns) - 2):  # from the first turn taken by a starving load on
        assert set(turns[i : i + 3]) == {"acme", "globex", "initech"}, turns


async def test_prewarm_does_not_drain_a_busy_adapter():
    """An admin pre-warm has no request waiting on it: it waits for a slot to free instead of
    making the adapter that is serving traffic yield."""
    engine = tiny_engine(max_loras=1, adapter_wait_s=0.02)
    await engine.load_adapter("acme")
    long = asyncio.ensure_future(
        collect(engine, [5, 9, 12, 30], "acme", SamplingParams(max_tokens=300, ignore_eos=True))
    )
    while not engine.adapters.get("acme").running:
        await asyncio.sleep(0.005)
    prewarm = asyncio.ensure_future(engine.load_adapter("globex"))
    await asyncio.sleep(0.2)  # ten times adapter_wait_s
    assert not prewarm.done() and engine.adapters.yields == 0
    assert not engine.adapters.get("acme").yielding
    last, _ = await asyncio.wait_for(long, 60)
    assert last.finish_reason == "length"
    await asyncio.wait_for(prewarm, 10)  # acme idle now: the pre-warm gets the slot
    assert engine.adapters.resident() == ["globex"]
    await engine.close()


async def test_admission_of_a_non_resident_adapter_undoes_cleanly():
    """A policy bug admits a request whose adapter is still loading: acquire() refuses before
    pinning anything, and the undo must not release a pin that was never taken."""
    engine = tiny_engine(scheduler="fcfs")
    gate = threading.Event()
    engine._forward.submit(gate.wait, 10)  # globex's copy queues behind this: not resident yet
    inner = engine.policy.policy
    schedule = engine.policy.schedule

    def forgets_adapter_ready(now, ctx):
        for req in list(inner._waiting):
            ctx.try_admit(req)
        return []

    engine.policy.schedule = forgets_adapter_ready
    with pytest.raises(EngineStepError, match="admitted while not resident"):
        await collect(engine, [5, 9, 12, 30], "globex", SamplingParams(max_tokens=4))
    engine.policy.schedule = schedule
    gate.set()
    await asyncio.sleep(0.1)
    entry = engine.adapters.get("globex")
    assert (entry.running, entry.waiting) == (0, 0)
    engine.remove_adapter("globex")  # refused if a pin had gone negative
    await engine.close()


async def test_drained_adapter_is_evicted_only_once_the_load_fits():
    """A small pool shared with base-model KV traffic: the starving load of a large adapter drains
    the busy small one, KV admissions leave room for the load meanwhile, and the small adapter
    is evicted only when its pages complete the room (not earlier, which handed the slot straight
    back to its own reload and cycled)."""
    engine = tiny_engine(
        max_loras=1, max_num_seqs=8, adapter_wait_s=0.05, scheduler="fcfs", num_pages=1 + engine_pages("initech") + 7
    )
    await engine.load_adapter("globex")
    stop = False

    async def loop(prompt, adapter, max_tokens):
        while not stop:
            await collect(engine, prompt, adapter, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    workers = [asyncio.ensure_future(loop(list(range(5, 45)), None, n)) for n in (30, 37)]
    workers += [asyncio.ensure_future(loop([5, 9, 12, 30], "globex", n)) for n in (6, 9, 13)]
    await asyncio.sleep(0.05)
    cold, _ = await asyncio.wait_for(collect(engine, [5, 9, 12, 30], "initech", SamplingParams(max_tokens=4, temperature=0.0)), 30)
    assert cold.finish_reason == "length"
    assert len(engine.adapters.evictions) <= 2, "the slot changed hands more than the one turn needs"
    stop = True
    await asyncio.wait_for(asyncio.gather(*workers), 30)
    await engine.close()


def engine_pages(adapter: str) -> int:
    return tiny_engine().adapter_info(adapter).num_pages


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_logits():
    """The request's seeded generator is a CPU generator; sampling CUDA logits with it must work."""
    logits = torch.randn(2, 50, device="cuda")
    rows = [
        SampleRow(SamplingParams(seed=7), torch.Generator().manual_seed(7), []),
        SampleRow(SamplingParams(top_p=0.9, top_k=5), None, []),
    ]
    tokens = sample(logits, rows).tokens
    again = sample(logits, [SampleRow(SamplingParams(seed=7), torch.Generator().manual_seed(7), []), rows[1]]).tokens
    assert tokens[0] == again[0]

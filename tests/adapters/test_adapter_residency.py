"""Adapter residency: a failed or cancelled load gives its lora slot and pages back, a cold
adapter is not starved by hot ones holding every slot (busy adapters yield in turn), and more
adapters stay resident than one batch may hold."""

from __future__ import annotations

import asyncio

import pytest
from engine_util import collect, engine_pages, tiny_engine

from lorapage import SamplingParams
from lorapage.errors import AdapterLoadError
from lorapage.scheduler.metrics import DISTINCT_BOUNDS
from lorapage.tiny import demo_adapter_dirs


async def test_adapter_copy_failure_returns_its_slot_and_pages():
    engine = tiny_engine(max_loras=2, max_resident_loras=2)
    free = engine.debug.pool_free_pages()

    def broken_copy(*args):
        raise RuntimeError("device copy failed")

    real_copy = engine.debug.adapters.loader.write_pages
    engine.debug.adapters.loader.write_pages = broken_copy
    with pytest.raises(AdapterLoadError):
        await collect(engine, [5, 9, 12, 30], "acme", SamplingParams(max_tokens=4))
    assert engine.debug.pool_free_pages() == free
    engine.debug.adapters.loader.write_pages = real_copy
    outs = await asyncio.gather(
        *(collect(engine, [5, 9, 12, 30], a, SamplingParams(max_tokens=4)) for a in ("acme", "globex"))
    )
    assert all(o.finish_reason == "length" for o, _ in outs)
    await engine.close()


async def test_adapter_removed_while_its_copy_is_queued_gives_back_slot_and_pages():
    """Unregistering an adapter whose copy is still queued (on CUDA, behind the step in flight on
    the forward thread) must not leak its slot and pages, nor free them before the copy has run."""
    engine = tiny_engine(max_loras=2, max_resident_loras=2)
    free, slots = engine.debug.pool_free_pages(), engine.debug.residency.slots.num_free
    gate = asyncio.Event()
    run_on_device = engine.debug.adapters.loader.run_on_device

    async def queued(fn):  # the copy waits its turn, as behind a busy forward thread
        await gate.wait()
        await run_on_device(fn)

    engine.debug.adapters.loader.run_on_device = queued
    engine.debug.adapters.ensure("acme@1")
    for _ in range(500):
        if engine.debug.pool_free_pages() < free:
            break
        await asyncio.sleep(0.01)
    assert engine.debug.pool_free_pages() < free, "the load should have reserved its pages"
    engine.admin.catalog.remove("acme")
    await asyncio.sleep(0.05)
    assert engine.debug.pool_free_pages() < free, "pages went back while their copy was still queued"
    gate.set()
    for _ in range(500):
        if engine.debug.pool_free_pages() == free:
            break
        await asyncio.sleep(0.01)
    assert engine.debug.pool_free_pages() == free and engine.debug.residency.slots.num_free == slots
    outs = await asyncio.gather(
        *(collect(engine, [5, 9, 12, 30], a, SamplingParams(max_tokens=4)) for a in ("globex", "initech"))
    )
    assert all(o.finish_reason == "length" for o, _ in outs)
    await engine.close()


async def test_cold_adapter_is_not_starved_by_hot_adapters_holding_every_slot():
    """Both slots belong to adapters that always have requests running and queued, so neither is
    ever idle enough to evict. A request for a third adapter must still be served: past
    ``adapter_wait_s`` its load makes one busy adapter yield and takes the slot, and the yielding
    adapter's queued requests are served again afterwards."""
    engine = tiny_engine(max_loras=2, max_resident_loras=2, max_num_seqs=4, adapter_wait_s=0.05)
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
    cold, _ = await asyncio.wait_for(
        collect(engine, [5, 9, 12, 30], "initech", SamplingParams(max_tokens=4, temperature=0.0)), 30
    )
    assert cold.text == "Init"  # four byte tokens of "Initech TPS report filed."
    after = dict(served)
    while any(served[a] <= after[a] for a in served):  # both hot adapters are served again
        await asyncio.sleep(0.01)
    stop = True
    await asyncio.wait_for(asyncio.gather(*workers), 30)
    assert not any(e.yielding for e in engine.debug.residency.adapters.values())
    assert engine.stats().adapter_yields >= 1
    await engine.close()


async def test_starving_loads_take_turns_in_order():
    """One slot, three adapters that always have requests. Each starving load waits its turn in
    line, so every three consecutive residency turns hold all three adapters (before, two of
    them could swap the slot again and again while the third waited)."""
    engine = tiny_engine(max_loras=1, max_resident_loras=1, max_num_seqs=8, adapter_wait_s=0.05)
    await engine.admin.load("acme")
    stop = False

    async def hot(adapter: str, max_tokens: int) -> None:
        while not stop:
            await collect(engine, [5, 9, 12, 30], adapter, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    workers = [asyncio.ensure_future(hot(a, n)) for a in ("acme", "globex", "initech") for n in (20, 31)]
    turns: list[str] = []
    for _ in range(3000):
        resident = [key.partition("@")[0] for key in engine.debug.residency.slots.resident()]
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


async def test_prewarm_does_not_make_a_busy_adapter_yield():
    """An admin pre-warm has no request waiting on it: it waits for a slot to free instead of
    making the adapter that is serving traffic yield."""
    engine = tiny_engine(max_loras=1, max_resident_loras=1, adapter_wait_s=0.02)
    await engine.admin.load("acme")
    long = asyncio.ensure_future(
        collect(engine, [5, 9, 12, 30], "acme", SamplingParams(max_tokens=300, ignore_eos=True))
    )
    while not engine.debug.residency.get("acme@1").running:
        await asyncio.sleep(0.005)
    prewarm = asyncio.ensure_future(engine.admin.load("globex"))
    await asyncio.sleep(0.2)  # ten times adapter_wait_s
    assert not prewarm.done() and engine.debug.residency.loads.yields == 0
    assert not engine.debug.residency.get("acme@1").yielding
    last, _ = await asyncio.wait_for(long, 60)
    assert last.finish_reason == "length"
    await asyncio.wait_for(prewarm, 10)  # acme idle now: the pre-warm gets the slot
    assert engine.debug.residency.slots.resident() == ["globex@1"]
    await engine.close()


async def test_yielding_adapter_is_evicted_only_once_the_load_fits():
    """A small pool shared with base-model KV traffic: the starving load of a large adapter makes
    the busy small one yield, KV admissions leave room for the load meanwhile, and the small adapter
    is evicted only when its pages complete the room (not earlier, which handed the slot straight
    back to its own reload and cycled)."""
    engine = tiny_engine(
        max_loras=1,
        max_resident_loras=1,
        max_num_seqs=8,
        adapter_wait_s=0.05,
        scheduler="fcfs",
        # initech fits beside one full-length (80-token) sequence, and no more.
        num_pages=1 + engine_pages("initech") + 20,
        max_model_len=80,
    )
    await engine.admin.load("globex")
    stop = False

    async def loop(prompt, adapter, max_tokens):
        while not stop:
            await collect(engine, prompt, adapter, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    workers = [asyncio.ensure_future(loop(list(range(5, 45)), None, n)) for n in (30, 37)]
    workers += [asyncio.ensure_future(loop([5, 9, 12, 30], "globex", n)) for n in (6, 9, 13)]
    await asyncio.sleep(0.05)
    cold, _ = await asyncio.wait_for(
        collect(engine, [5, 9, 12, 30], "initech", SamplingParams(max_tokens=4, temperature=0.0)), 30
    )
    assert cold.finish_reason == "length"
    assert len(engine.debug.residency.slots.evictions) <= 2, "the slot changed hands more than the one turn needs"
    stop = True
    await asyncio.wait_for(asyncio.gather(*workers), 30)
    await engine.close()


async def test_resident_adapters_outnumber_the_distinct_adapters_of_a_batch():
    """max_loras=2, max_resident_loras=6: six adapters stay resident together (no eviction, no
    reload) while no step's batch ever holds more than two of them."""
    engine = tiny_engine(max_loras=2, max_resident_loras=6, max_num_seqs=8)
    dirs = list(demo_adapter_dirs().values())
    names = [f"k{i}" for i in range(6)]
    for i, name in enumerate(names):
        engine.add_adapter(name, dirs[i % len(dirs)])
    assert engine.stats().lora_slots == 6 and engine.debug.tables.page_table.shape[0] == 7  # slot 0: none
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    try:
        for _ in range(2):  # twice: the second round finds all six resident
            outs = await asyncio.gather(*(collect(engine, [5, 9, 12, 30], n, params) for n in names for _ in range(2)))
            assert all(o.finish_reason == "length" for o, _ in outs)
            assert {f"{n}@1" for n in names} <= set(engine.debug.residency.slots.resident())
        assert engine.stats().evictions_per_minute == 0
        assert sum(engine.debug.adapter_metrics.loads.values()) == 6  # each loaded once
        distinct = engine.debug.scheduler_metrics.distinct_adapters
        two = DISTINCT_BOUNDS.index(2)
        assert distinct.counts[two] > 0  # steps did run two adapters at once
        assert sum(distinct.counts[two + 1 :]) == 0  # and never more
    finally:
        await engine.close()

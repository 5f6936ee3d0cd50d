"""The engine's traffic tiers end to end: requests counted by the usage ledger, written to the
registry's traffic table when the engine closes, read back after a restart; a hot adapter ends up
kept resident, a warm one in host RAM, a cold one where it was."""

from __future__ import annotations

import asyncio

from engine_util import collect

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.registry.audit import AuditQuery
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

CONFIG = dict(
    model=str(TINY_BASE_DIR),
    max_loras=4,
    max_resident_loras=4,
    max_lora_rank=64,
    block_size=4,
    enable_prefix_caching=False,
    tier_hot_requests_per_hour=3,
    tier_hot_share=0.9,  # acme's 4 of 5 requests is 80 %: hot by count, globex's 20 % not
)


async def until(done, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_hot_adapter_ends_up_resident_and_a_warm_one_in_host_ram_after_a_restart(tmp_path):
    config = EngineConfig(state_dir=str(tmp_path / "state"), **CONFIG)
    engine = Engine(config)
    for name, path in demo_adapter_dirs().items():
        engine.add_adapter(name, path)
    sampling = SamplingParams(max_tokens=3, temperature=0)
    for _ in range(4):
        await collect(engine, "Hello", "acme", sampling)
    await collect(engine, "Hello", "globex", sampling)
    rows = await engine.admin.traffic("acme")  # not written yet: the ledger's counts
    assert [(r.key, r.requests) for r in rows] == [("acme@1", 4)] and rows[0].output_tokens == 12
    await engine.close()  # writes the counts

    engine = Engine(config)  # the versions and their traffic come back from the registry
    try:
        assert engine.debug.residency.slots.resident() == [] and engine.debug.residency.host.keys() == []
        assert await engine.admin.refresh_tiers() == {"acme@1": "hot", "globex@1": "warm"}
        await until(
            lambda: engine.debug.residency.is_resident("acme@1") and "globex@1" in engine.debug.residency.host.keys()
        )
        assert engine.debug.residency.pins.hot() == ["acme@1"] and engine.debug.residency.pins.pinned() == []
        assert engine.debug.residency.slots.resident() == ["acme@1"]  # globex only in host RAM; initech cold, on disk
        assert engine.debug.residency.tier("globex@1") == "ram" and engine.debug.residency.tier("initech@1") == "disk"
        info = engine.admin.info("acme")
        assert (info.traffic_tier, info.kept_hot, info.status, info.pinned) == ("hot", True, "resident", False)
        assert engine.admin.info("initech").traffic_tier == "cold"
        # Kept resident: an admin's unload still wins (and it is hot no more until the next look).
        assert await engine.admin.unload("acme")
        assert engine.debug.residency.pins.hot() == []
        assert engine.stats().adapters_kept_hot == 0
        await engine.admin.refresh_tiers()
        await until(lambda: engine.debug.residency.is_resident("acme@1"))
        rows = await engine.admin.traffic("acme")
        assert [(r.key, r.requests, r.output_tokens) for r in rows] == [("acme@1", 4, 12)]
    finally:
        await engine.close()


async def test_the_engine_writes_the_table_and_judges_the_tiers_every_interval_on_its_own(tmp_path):
    config = EngineConfig(state_dir=str(tmp_path / "state"), tier_interval_s=0.05, **CONFIG)
    engine = Engine(config)
    try:
        for name, path in demo_adapter_dirs().items():
            engine.add_adapter(name, path)
        for _ in range(3):
            await collect(engine, "Hello", "initech", SamplingParams(max_tokens=2, temperature=0))
        await until(lambda: engine.debug.tiers.tier("initech@1").value == "hot")
        await until(lambda: engine.debug.residency.pins.hot() == ["initech@1"])
        for _ in range(3000):  # the last step's tokens go out with the next write
            stored = await asyncio.to_thread(engine.debug.tiers.store.traffic_rows, 0)
            if [(r.key, r.requests, r.output_tokens) for r in stored] == [("initech@1", 3, 6)]:
                break
            await asyncio.sleep(0.02)
        assert [(r.key, r.requests, r.output_tokens) for r in stored] == [("initech@1", 3, 6)]
        assert engine.debug.usage.traffic == {}  # written: nothing waits in the ledger
    finally:
        await engine.close()


async def test_the_audit_trail_is_pruned_past_its_retention_with_the_traffic_writes(tmp_path):
    """With a retention shorter than the rows' age, the registry's audit trail empties on the
    engine's own schedule, off the loop (issue 38, finding 6)."""
    config = EngineConfig(state_dir=str(tmp_path / "state"), audit_retention_days=1e-9, **CONFIG)
    engine = Engine(config)
    try:
        for name, path in demo_adapter_dirs().items():
            engine.add_adapter(name, path)
        await engine.admin.catalog.record("load", "acme", actor="a")
        assert await engine.admin.catalog.audit(AuditQuery())
        await engine.admin.refresh_tiers()
        assert await engine.admin.catalog.audit(AuditQuery()) == []
    finally:
        await engine.close()

"""Residency by value: idle adapters leave the pool by recent rate x measured reload cost of the
tier each would fall to / pages; admin pins hold adapters resident within their bounds and
survive a restart; a tenant's request prefetches its other recent adapters into host RAM without
delaying any load into the pool."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from engine_util import collect
from server_harness import assert_openai_error, make_engine, running_server

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.adapters.cache import AdapterInfo
from lorapage.adapters.value import LoadTier, RecentAdapters, ReloadCosts, Stage
from lorapage.errors import ConflictError, PinLimitError
from lorapage.registry.store import SCHEMA_VERSION, Registry
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

PROMPT = [5, 9, 12, 30]
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)


async def pin(engine: Engine, name: str) -> AdapterInfo:
    """A pin on an embedded engine: the catalog checks it against the bounds, commits and applies
    it; then the version is loaded (the admin's pin over HTTP does the same, and undoes it when
    the load fails)."""
    key = engine.admin.catalog.resolve_version(name)
    await engine.admin.catalog.set_pinned(key, True)
    await engine.admin.make_resident(key)
    return engine.admin.info(key)


async def unpin(engine: Engine, name: str) -> None:
    await engine.admin.catalog.set_pinned(engine.admin.catalog.resolve_version(name), False)


class FrozenClock:
    """The engine's clock, moved by hand: request rates decay only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_with(clock=None, *, extra: dict[str, str] | None = None, **overrides) -> Engine:
    cfg = dict(model=str(TINY_BASE_DIR), max_lora_rank=64, block_size=4, enable_prefix_caching=False)
    cfg.update(overrides)
    engine = Engine(EngineConfig(**cfg), **({"clock": clock} if clock is not None else {}))
    dirs = demo_adapter_dirs()
    for name, path in dirs.items():
        engine.add_adapter(name, path)
    for name, like in (extra or {}).items():  # another id over a demo adapter's files
        engine.add_adapter(name, dirs[like])
    return engine


def set_costs(engine: Engine, *, copy: float, read: float) -> None:
    """Feed the EWMA until it holds these seconds per page (what timed loads would teach it)."""
    for _ in range(200):
        engine.debug.adapters.costs.observe(Stage.COPY, copy, 1)
        engine.debug.adapters.costs.observe(Stage.READ, read, 1)


def force_one_eviction(engine: Engine) -> list[str]:
    before = set(engine.debug.residency.slots.resident())
    engine.debug.adapters.room_for_kv(engine.debug.pool.num_free + 1, reserve=False)
    return sorted(before - set(engine.debug.residency.slots.resident()))


def test_reload_costs_start_from_seeds_and_follow_measurements():
    costs = ReloadCosts(page_bytes=1 << 20)
    ram, disk, remote = (costs.reload_s(t, 10) for t in (LoadTier.RAM, LoadTier.DISK, LoadTier.REMOTE))
    assert 0 < ram < disk < remote  # before any load: a copy < a read + copy < a download + both
    for _ in range(50):
        costs.observe(Stage.COPY, 2.0, 4)  # 0.5 s per page
    assert costs.seconds_per_page(Stage.COPY) == pytest.approx(0.5, rel=1e-3)
    assert costs.measured[Stage.COPY] == 50 and costs.measured[Stage.READ] == 0
    costs.observe(Stage.READ, float("nan"), 4)  # a broken measurement is ignored
    per_page = costs.seconds_per_page(Stage.COPY) + costs.seconds_per_page(Stage.READ)
    assert costs.measured[Stage.READ] == 0 and costs.reload_s(LoadTier.DISK, 10) == pytest.approx(10 * per_page)


def test_recent_adapters_are_bounded_per_tenant_in_time_and_in_tenants():
    recent = RecentAdapters(per_tenant=2, window_s=10.0, max_tenants=2)
    assert recent.use("t", "a", 0.0) == []
    recent.use("t", "b", 1.0)
    assert recent.use("t", "c", 2.0) == ["b", "a"]  # most recent first
    assert recent.use("t", "a", 3.0) == ["c", "b"]  # only the last two are kept ("a" was dropped)
    assert recent.use("t", "b", 20.0) == []  # older than the window
    recent.use("u", "x", 20.0)
    recent.use("v", "y", 20.0)  # a third tenant: the least recently active ("t") is forgotten
    assert recent.use("t", "z", 21.0) == []


async def test_equal_rates_evict_the_adapter_cheapest_to_reload():
    """initech falls to disk (its host copy was pushed out), globex to host RAM: at equal rates
    globex goes first, though it is smaller (rate / pages alone would evict initech)."""
    clock = FrozenClock()
    engine = engine_with(clock, max_loras=3, max_resident_loras=3, max_cpu_loras=1)
    try:
        await collect(engine, PROMPT, "initech", SHORT, tenant="a")
        await collect(engine, PROMPT, "globex", SHORT, tenant="b")
        assert engine.debug.residency.host.keys() == ["globex@1"]
        set_costs(engine, copy=0.001, read=0.1)
        assert force_one_eviction(engine) == ["globex@1"]
        assert engine.debug.adapter_metrics.evictions["globex"] == 1
    finally:
        await engine.close()


async def test_recent_traffic_outweighs_a_cheap_tier():
    """Ten half-lives later initech's one old request is worth little: it goes first although
    it would fall to disk and globex only to host RAM."""
    clock = FrozenClock()
    engine = engine_with(clock, max_loras=3, max_resident_loras=3, max_cpu_loras=1)
    try:
        await collect(engine, PROMPT, "initech", SHORT, tenant="a")
        await collect(engine, PROMPT, "globex", SHORT, tenant="b")
        clock.now += 600.0
        await collect(engine, PROMPT, "globex", SHORT, tenant="b")
        set_costs(engine, copy=0.001, read=0.01)
        assert force_one_eviction(engine) == ["initech@1"]
    finally:
        await engine.close()


async def test_pins_are_bounded_by_pages_and_slots_with_the_numbers():
    # 10528 pool pages x 0.008 = 84 pages for pins: acme (37) + globex (6) fit, initech (73) not.
    engine = engine_with(max_loras=8, max_resident_loras=8, max_pinned_fraction=0.008)
    try:
        assert engine.debug.residency.pins.limit() == 84
        assert (await pin(engine, "acme")).pinned
        await pin(engine, "globex@1")
        assert engine.admin.pins_to_load() == []  # both loaded as they were pinned
        with pytest.raises(PinLimitError, match="asks for 73 pages"):
            engine.admin.check_pin("initech")  # asked before pinning: nothing is pinned
        with pytest.raises(PinLimitError) as err:
            await pin(engine, "initech")
        assert err.value.status == 409 and err.value.code == "pin_limit_exceeded"
        message = err.value.message
        assert "asks for 73 pages" in message and "hold 43 pages" in message
        assert "may hold 84 of the pool's 10528" in message and "max_pinned_fraction 0.008" in message
        assert not engine.debug.residency.get("initech@1").pinned
        stats = engine.stats()
        assert stats.adapter_pinned_pages == 43
        # what fleet placement reads: pinned and resident pages cannot be evicted; nothing queued
        assert stats.adapter_held_pages == 43 and stats.tokens_in_flight == 0 and stats.pool_page_bytes > 0
        # the guard's room: the 8 lora slots of the largest adapter's pages, not the 10528-page pool
        assert stats.adapter_room_pages == 8 * engine.debug.tables.page_table.shape[1] < stats.pool_pages_total
        await unpin(engine, "acme")
        await pin(engine, "initech")  # 6 + 73 fits now
        assert engine.stats().adapters_pinned == 2
    finally:
        await engine.close()
    engine = engine_with(max_loras=2, max_resident_loras=2)
    try:
        await pin(engine, "acme")
        with pytest.raises(PinLimitError, match="no unpinned lora slot"):
            await pin(engine, "globex")
    finally:
        await engine.close()


async def test_a_pinned_adapter_is_never_evicted_nor_made_to_yield():
    """Both slots are taken: pinned acme (idle, no traffic: the least valuable) and hot globex.
    A request for initech must be served by globex yielding, never by acme leaving."""
    engine = engine_with(max_loras=2, max_resident_loras=2, max_num_seqs=4, adapter_wait_s=0.05)
    try:
        info = await pin(engine, "acme")
        assert info.tier == "gpu" and info.pinned
        pinned_slot = engine.debug.residency.get("acme@1").slot
        assert not engine.debug.adapters.room_for_kv(
            engine.debug.pool.capacity, reserve=False
        )  # nothing else to evict: acme stays
        assert engine.debug.residency.get("acme@1").slot == pinned_slot
        with pytest.raises(ConflictError, match="pinned"):
            await engine.admin.unload("acme")

        # Long requests, all running before initech arrives: globex is busy the whole time initech
        # waits (a loop of short ones left gaps in which globex was idle and simply evicted).
        long = SamplingParams(max_tokens=300, ignore_eos=True)
        hot_tasks = [asyncio.create_task(collect(engine, PROMPT, "globex", long)) for _ in range(3)]
        while len(engine.debug.step_planner.running) < 3:
            await asyncio.sleep(0.01)
        out, _ = await asyncio.wait_for(collect(engine, PROMPT, "initech", SHORT), 60)
        assert out.finish_reason == "length"
        assert engine.debug.residency.loads.yields >= 1
        assert engine.debug.residency.get("acme@1").slot == pinned_slot
        await asyncio.gather(*hot_tasks)
    finally:
        await engine.close()


async def test_pins_survive_a_restart(tmp_path):
    state = str(tmp_path / "state")
    engine = engine_with(state_dir=state, max_loras=4, max_resident_loras=4)
    try:
        await pin(engine, "globex")
    finally:
        await engine.close()

    engine = engine_with(state_dir=state, max_loras=4, max_resident_loras=4)
    try:
        entry = engine.debug.residency.get("globex@1")
        assert entry.pinned and not entry.slot  # restored from the registry, loaded on the loop
        assert await engine.admin.restore_pins() == ["globex@1"]
        for _ in range(3000):  # the slot is given before the copy lands: wait for the tier itself
            if engine.admin.info("globex").tier == "gpu":
                break
            await asyncio.sleep(0.01)
        assert engine.admin.info("globex").tier == "gpu"
        await unpin(engine, "globex")
    finally:
        await engine.close()

    engine = engine_with(state_dir=state, max_loras=4, max_resident_loras=4)
    try:
        assert not engine.debug.residency.get("globex@1").pinned
    finally:
        await engine.close()


def test_a_schema_1_registry_is_migrated_and_keeps_its_versions(tmp_path):
    path = tmp_path / "registry.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE adapters (id TEXT PRIMARY KEY, owner TEXT, current INTEGER,
                               next_version INTEGER NOT NULL, created REAL NOT NULL);
        CREATE TABLE versions (id TEXT NOT NULL REFERENCES adapters(id), version INTEGER NOT NULL,
                               digest TEXT NOT NULL, source TEXT NOT NULL, base_digest TEXT NOT NULL,
                               spec TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (id, version));
        INSERT INTO meta VALUES ('schema', '1');
        INSERT INTO adapters VALUES ('acme', 'alpha', 1, 2, 1.0);
        INSERT INTO versions VALUES ('acme', 1, 'd', 'file:///x', 'b', '{}', 1.0);
        """
    )
    db.commit()
    db.close()
    registry = Registry(path)
    (row,) = registry.versions()
    assert (row.key, row.digest, row.pinned) == ("acme@1", "d", False)
    registry.set_pinned("acme", 1, True)
    registry.add_version("acme", "alpha", digest="e", source="file:///y", base_digest="b", spec="{}", activate=True)
    registry.close()
    registry = Registry(path)
    assert [(r.key, r.pinned) for r in registry.versions()] == [("acme@1", True), ("acme@2", False)]
    registry.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (str(SCHEMA_VERSION),)
    db.close()


class ReadGates:
    """Holds each read of an adapter's files until the test opens that adapter's gate (wraps the
    loader's read, which every read of files goes through); ``started`` lists the reads begun."""

    def __init__(self, engine: Engine) -> None:
        loader = engine.debug.adapters.loader
        real = loader.read
        self.started: list[str] = []
        self._gates: dict[str, asyncio.Event] = {}

        async def gated(version, tier, downloaded=lambda: None):
            self.started.append(version.name)
            await self._gate(version.name).wait()
            return await real(version, tier, downloaded)

        loader.read = gated

    def _gate(self, name: str) -> asyncio.Event:
        return self._gates.setdefault(name, asyncio.Event())

    def open(self, *names: str) -> None:
        for name in names:
            self._gate(name).set()


async def wait_for(predicate, what: str) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_tenants_request_prefetches_its_other_adapters_after_the_load_has_read():
    """max_cpu_loras=1 and max_resident_loras=1: acme falls off host RAM and the pool once tenant t moves
    on. t's request for initech queues a prefetch of acme, which starts only once initech's own
    read is done, takes no slot, and makes t's next acme request a host-RAM hit."""
    engine = engine_with(max_loras=1, max_resident_loras=1, max_cpu_loras=1)
    try:
        await collect(engine, PROMPT, "acme", SHORT, tenant="t")
        await collect(engine, PROMPT, "globex", SHORT, tenant="t")
        assert engine.debug.residency.tier("acme@1") == "disk"
        reads = ReadGates(engine)
        request = asyncio.create_task(collect(engine, PROMPT, "initech", SHORT, tenant="t"))
        await wait_for(lambda: reads.started, "initech's read")
        await asyncio.sleep(0.05)
        assert (
            reads.started == ["initech@1"] and engine.debug.residency.prefetch.counts["started"] == 0
        )  # waits for the load
        reads.open("initech@1", "acme@1")
        await request
        await wait_for(lambda: engine.debug.residency.prefetch.counts["done"] == 1, "the prefetch")
        assert reads.started == ["initech@1", "acme@1"]
        assert engine.debug.residency.slots.resident() == ["initech@1"]  # the prefetch took no slot
        assert engine.debug.residency.tier("acme@1") == "ram"
        out, _ = await collect(engine, PROMPT, "acme", SHORT, tenant="t")
        assert out.adapter_tier == "ram"
        assert engine.stats().adapter_prefetches_done == 1
    finally:
        await engine.close()


async def test_prefetches_run_one_at_a_time_with_two_io_threads():
    """io_threads=2 leaves one I/O thread to loads: one prefetch reads at a time, the rest queue;
    another tenant's adapters are not prefetched."""
    others = ("acme@1", "globex@1", "acme2@1", "globex2@1")
    engine = engine_with(
        max_loras=8, max_resident_loras=8, io_threads=2, extra={"acme2": "acme", "globex2": "globex", "solo": "acme"}
    )
    try:
        recent = engine.debug.residency.recent  # t used these four lately (none was loaded: all on disk)
        for name in others:
            recent.use("t", name, engine.debug.clock())
        recent.use("u", "solo@1", engine.debug.clock())
        reads = ReadGates(engine)
        request = asyncio.create_task(collect(engine, PROMPT, "initech", SHORT, tenant="t"))
        await wait_for(lambda: reads.started, "initech's read")
        reads.open("initech@1")
        await request
        await wait_for(lambda: len(reads.started) == 2, "the first prefetch")
        await asyncio.sleep(0.05)
        assert len(reads.started) == 2 and len(engine.debug.residency.prefetch.waiting) == 3  # one at a time
        reads.open(*others)
        await wait_for(lambda: engine.debug.residency.prefetch.counts["done"] == 4, "four prefetches")
        assert sorted(reads.started[1:]) == sorted(others)
        assert sorted(engine.debug.residency.host.keys()) == sorted((*others, "initech@1"))
        assert engine.debug.residency.slots.resident() == ["initech@1"]
    finally:
        await engine.close()


async def test_pin_routes_describe_the_adapter_and_answer_409_with_the_numbers():
    engine = make_engine(max_loras=8, max_resident_loras=8, max_pinned_fraction=0.008)
    try:
        async with running_server(engine) as srv:
            admin = srv.admin()
            status, body, _ = await srv.request("PUT", "/v1/adapters/acme/pin", headers=admin)
            assert status == 200 and body["pinned"] is True and body["tier"] == "gpu" and body["version"] == 1
            assert (await srv.request("PUT", "/v1/adapters/acme/pin", headers=srv.auth("alpha")))[0] in (401, 403)
            await srv.request("PUT", "/v1/adapters/globex@1/pin", headers=admin)
            status, body, _ = await srv.request("PUT", "/v1/adapters/initech/pin", headers=admin)
            assert_openai_error(body, 409, "id")
            assert status == 409 and body["error"]["code"] == "pin_limit_exceeded"
            pages = {name: engine.admin.info(name).num_pages for name in ("acme", "globex", "initech")}
            limit, cap = engine.debug.residency.pins.limit(), engine.debug.pool.capacity
            assert pages["acme"] + pages["globex"] <= limit < sum(pages.values())  # what this test relies on
            numbers = (
                f"asks for {pages['initech']} pages; pins hold {pages['acme'] + pages['globex']} pages "
                f"and may hold {limit} of the pool's {cap}"
            )
            assert numbers in body["error"]["message"]
            status, body, _ = await srv.request("POST", "/internal/adapters/acme/unload", headers=admin)
            assert status == 409
            status, body, _ = await srv.request("DELETE", "/v1/adapters/acme/pin", headers=admin)
            assert status == 200 and body["pinned"] is False and body["tier"] == "gpu"
            status, body, _ = await srv.request("GET", "/v1/adapters/globex", headers=admin)
            assert body["pinned"] is True
            assert (await srv.request("PUT", "/v1/adapters/nope/pin", headers=admin))[0] == 404
    finally:
        await engine.close()

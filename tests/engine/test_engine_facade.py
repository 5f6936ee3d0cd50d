"""The Engine's narrow reads for its callers (the server, the fleet's replicas): adapter ids and
owners, a generation that moves with every change, whether a version is here, what a delete would
remove, the VTC counters, and a frozen stats record. (Channels and history are read over HTTP in
test_audit.py; pins in test_adapter_value.py; the mirror in test_fleet_registry.py.)"""

from __future__ import annotations

import dataclasses

import pytest
from engine_util import collect, tiny_engine

from lorapage import SamplingParams
from lorapage.errors import AdapterNotFoundError, ConflictError
from lorapage.tiny import demo_adapter_dirs

pytestmark = pytest.mark.asyncio


async def test_adapter_ids_owners_generation_and_versions_here():
    engine = tiny_engine()
    try:
        demo = sorted(demo_adapter_dirs())
        assert sorted(engine.admin.catalog.index.ids()) == demo and engine.admin.catalog.owners() == {}
        assert engine.admin.has_version(f"{demo[0]}@1") and not engine.admin.has_version(f"{demo[0]}@2")
        before = engine.admin.catalog.generation
        engine.add_adapter("owned", demo_adapter_dirs()[demo[0]], owner="alpha")
        assert engine.admin.catalog.generation > before
        assert engine.admin.catalog.owners() == {"owned": "alpha"} and engine.admin.has_version("owned@1")
        assert engine.admin.catalog.index.removable("owned") == ["owned@1"]
        engine.add_adapter("owned", demo_adapter_dirs()[demo[1]], owner="alpha")  # owned@2, the current one
        with pytest.raises(ConflictError):
            engine.admin.catalog.index.removable("owned@2")  # the current one of several
        assert engine.admin.catalog.index.removable("owned@1") == ["owned@1"] and engine.admin.has_version(
            "owned@1"
        )  # nothing removed
        with pytest.raises(AdapterNotFoundError):
            engine.admin.catalog.index.removable("nope")
    finally:
        await engine.close()


@pytest.mark.parametrize("scheduler", ["vtc", "fcfs"])
async def test_vtc_counters_are_the_tenants_served_and_none_under_fcfs(scheduler):
    engine = tiny_engine(scheduler=scheduler)
    try:
        await collect(engine, "hello", None, SamplingParams(max_tokens=2), tenant="alpha")
        counters = engine.metrics().vtc_counters()
        if scheduler == "vtc":
            assert list(counters) == ["alpha"] and counters["alpha"] > 0
        else:
            assert counters == {}
    finally:
        await engine.close()


async def test_stats_is_a_frozen_record():
    engine = tiny_engine()
    try:
        stats = engine.stats()
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.queue_depth = 1  # type: ignore[misc]
        assert stats.registered_adapters == len(engine.admin.catalog.index.ids()) and stats.running == 0
        assert stats.pool_pages_free + stats.pool_pages_adapters + stats.pool_pages_kv == stats.pool_pages_total
    finally:
        await engine.close()

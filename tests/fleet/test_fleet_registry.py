"""The fleet's registry (held by the ingress) and an engine mirroring it, without Ray.

A real SQLite registry file, real engines of the tiny model: one prepares adapters (as the
replica a registration is routed to does), another mirrors the registry's changes (as every
replica does from its heartbeat replies) and serves them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import AdapterBaseMismatchError, AdapterNotFoundError, ConflictError
from lorapage.fleet.messages import SyncReply
from lorapage.fleet.registry import FleetRegistry
from lorapage.registry.store import REGISTRY_FILE, Registry
from lorapage.tiny import DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs

GREEDY = SamplingParams(max_tokens=48, temperature=0)


@pytest.fixture(scope="module")
def engines():
    """(the engine that prepares, the engine that mirrors)."""
    config = EngineConfig(model=str(TINY_BASE_DIR), device="cpu")
    preparer, mirror = Engine(config), Engine(config)
    yield preparer, mirror
    for engine in (preparer, mirror):
        asyncio.run(engine.close())


def prepared(engine: Engine, name: str):
    return asyncio.run(engine.admin.catalog.preparer.prepare(demo_adapter_dirs()[name]))


def apply(engine: Engine, reply: SyncReply) -> list[str]:
    """What a replica does with a reply's ids (replica.py); returns the keys it could not drop yet."""
    if reply.full:
        listed = {s.adapter_id for s in reply.ids}
        for adapter_id in [i for i in engine.admin.catalog.index.ids() if i not in listed]:
            engine.admin.catalog.mirror(adapter_id, None, None, [])
    busy = []
    for state in reply.ids:
        busy += engine.admin.catalog.mirror(state.adapter_id, state.owner, state.current, list(state.versions))
    return busy


async def answer(engine: Engine, adapter: str) -> str:
    async for out in engine.generate("Hello there", adapter, GREEDY):
        pass
    return out.text


def test_changes_since_a_generation_and_a_restart(tmp_path: Path, engines) -> None:
    preparer, _ = engines
    path = tmp_path / REGISTRY_FILE
    fleet = FleetRegistry(Registry(path))
    acme, globex = prepared(preparer, "acme"), prepared(preparer, "globex")
    row, created = fleet.add("newco", "alpha", acme, activate=True)
    assert (row.key, created) == ("newco@1", True)
    assert fleet.add("newco", "alpha", acme, activate=True) == (row, False)  # same content: same version
    with pytest.raises(ConflictError):
        fleet.add("newco", "beta", globex, activate=True)  # alpha's id
    fleet.add("other", None, globex, activate=True)

    first = fleet.changes_since("", 0, {"alpha": 1.0})
    assert first.full and {s.adapter_id for s in first.ids} == {"newco", "other"}
    assert first.tenant_weights == {"alpha": 1.0}
    v2, _ = fleet.add("newco", "alpha", globex, activate=False)
    fleet.drop("other@1")
    later = fleet.changes_since(first.epoch, first.generation, {})
    assert not later.full and [s.adapter_id for s in later.ids] == ["newco"]
    assert [r.key for r in later.ids[0].versions] == ["newco@1", "newco@2"] and later.ids[0].current == 1
    assert later.unloads == ("other@1",)
    assert fleet.changes_since(later.epoch, later.generation, {}).ids == ()  # nothing new

    fleet.set_current("newco", 2)
    asyncio.run(fleet.set_pinned("newco@2", True))
    fleet.remove("other")
    gone = fleet.changes_since(later.epoch, later.generation, {})
    assert {s.adapter_id: len(s.versions) for s in gone.ids} == {"newco": 2, "other": 0}
    fleet.base_digest = acme.base_digest
    assert fleet.resolve_version("newco") == "newco@2"
    with pytest.raises(AdapterNotFoundError):
        fleet.resolve_version("other")
    fleet.base_digest = "0" * 64  # replicas on another base
    with pytest.raises(AdapterBaseMismatchError):
        fleet.resolve_version("newco")

    # A restarted ingress reads the same file: every version, alias and pin, in a new epoch; a
    # replica that counted in the old one gets everything again, and nothing of a deleted id.
    reopened = FleetRegistry(Registry(path))
    assert reopened.epoch != fleet.epoch
    again = reopened.changes_since(fleet.epoch, fleet.generation, {})
    assert again.full and [s.adapter_id for s in again.ids] == ["newco"]
    (state,) = again.ids
    assert state.current == 2 and state.owner == "alpha"
    assert [(r.key, r.digest, r.pinned) for r in state.versions] == [
        ("newco@1", acme.digest, False),
        ("newco@2", v2.digest, True),
    ]


def test_a_mirroring_engine_serves_what_the_registry_says(tmp_path: Path, engines) -> None:
    preparer, mirror = engines
    fleet = FleetRegistry(Registry(":memory:"))
    fleet.add("newco", "alpha", prepared(preparer, "acme"), activate=True)
    fleet.add("newco", "alpha", prepared(preparer, "globex"), activate=False)
    reply = fleet.changes_since("", 0, {})
    assert apply(mirror, reply) == []
    assert asyncio.run(answer(mirror, "newco@1")) == DEMO_MARKERS["acme"]
    assert asyncio.run(answer(mirror, "newco@2")) == DEMO_MARKERS["globex"]
    assert mirror.admin.catalog.resolve_version("newco") == "newco@1"
    fleet.set_current("newco", 2)
    asyncio.run(fleet.set_pinned("newco@2", True))
    reply2 = fleet.changes_since(reply.epoch, reply.generation, {})
    apply(mirror, reply2)
    assert mirror.admin.catalog.resolve_version("newco") == "newco@2" and mirror.debug.residency.get("newco@2").pinned

    async def drop_while_running() -> tuple[list[str], list[str]]:
        # A version the registry dropped stays while a request runs on it, and goes after.
        fleet.remove("newco@1")
        update = fleet.changes_since(reply2.epoch, reply2.generation, {})
        stream = mirror.generate("Hello there", "newco@1", GREEDY)
        await anext(stream)
        busy = apply(mirror, update)
        async for _ in stream:
            pass
        return busy, apply(mirror, update)

    busy, later = asyncio.run(drop_while_running())
    assert busy == ["newco@1"] and later == []
    with pytest.raises(AdapterNotFoundError):
        mirror.admin.catalog.resolve_version("newco@1")
    # A full reply from a restarted (empty) registry drops every id the mirror holds.
    apply(mirror, FleetRegistry(Registry(":memory:")).changes_since("", 0, {}))
    assert mirror.admin.catalog.index.ids() == [] and mirror.stats().registered_adapters == 0

"""Routing policies: rendezvous stability, least-loaded owners, spill, temporary owners, Ray's model."""

from __future__ import annotations

import pytest

from lorapage.fleet.routing import (
    AffinityRouter,
    RayDefaultRouter,
    ReplicaView,
    make_router,
    rendezvous_owners,
)


def _fleet(
    n: int, in_flight: dict[str, int] | None = None, **residency: dict[str, frozenset[str]]
) -> list[ReplicaView]:
    in_flight = in_flight or {}
    views = []
    for i in range(n):
        rid = f"r{i}"
        tiers = {tier: by_replica.get(rid, frozenset()) for tier, by_replica in residency.items()}
        views.append(ReplicaView(rid, in_flight.get(rid, 0), 8, **tiers))
    return views


def test_rendezvous_moves_only_adapters_of_the_replica_that_left() -> None:
    replicas = [f"r{i}" for i in range(10)]
    adapters = [f"a{i}" for i in range(2000)]
    before = {a: rendezvous_owners(a, replicas, 2) for a in adapters}
    after = {a: rendezvous_owners(a, [r for r in replicas if r != "r3"], 2) for a in adapters}
    moved = [a for a in adapters if before[a] != after[a]]
    assert all("r3" in before[a] for a in moved)  # nobody else's owners changed
    # r3 owned about k/K = 2/10 of adapters; only those move
    assert 0.15 < len(moved) / len(adapters) < 0.25
    for a in moved:  # the surviving owner stays, promoted if it was second
        assert [r for r in before[a] if r != "r3"][0] in after[a]


def test_rendezvous_is_stable_across_order_and_calls() -> None:
    ids = ["x", "y", "z", "w"]
    assert rendezvous_owners("a", ids, 2) == rendezvous_owners("a", list(reversed(ids)), 2)
    assert len(set(rendezvous_owners("a", ids, 4))) == 4


def test_affinity_sends_to_least_loaded_owner_and_prefers_resident() -> None:
    router = AffinityRouter(owners=2)
    ids = [f"r{i}" for i in range(6)]
    first, second = rendezvous_owners("ad", ids, 2)
    views = _fleet(6, {first: 3, second: 1})
    assert router.choose("ad", views) == second
    # resident in the pool on the busier owner: within the bonus (0.25 * 8 = 2 requests) it wins
    views = _fleet(6, {first: 3, second: 2}, pool={first: frozenset({"ad"})})
    assert router.choose("ad", views) == first


def test_affinity_spills_when_owners_saturated_and_remembers_temporary_owner() -> None:
    router = AffinityRouter(owners=2, spill_load=0.5, temp_ttl=3)
    ids = [f"r{i}" for i in range(6)]
    owners = rendezvous_owners("ad", ids, 2)
    busy = {rid: 4 for rid in owners}  # at 0.5 * capacity 8
    busy.update({rid: 1 for rid in ids if rid not in owners})
    spill_to = min(rid for rid in ids if rid not in owners)
    assert router.choose("ad", _fleet(6, busy)) == spill_to
    assert router.spills == 1 and router.temporary_owners("ad") == [spill_to]
    # owners still busy, the temporary owner has room: it is a candidate now, no new spill
    assert router.choose("ad", _fleet(6, busy)) == spill_to
    assert router.spills == 1
    # once owners have room again, and after temp_ttl choices, the temporary owner is forgotten
    for _ in range(4):
        router.choose("other", _fleet(6))
    assert router.choose("ad", _fleet(6)) in owners
    assert router.temporary_owners("ad") == []


def test_affinity_temporary_owners_are_bounded() -> None:
    router = AffinityRouter(owners=1, spill_load=0.1, max_temp_owners=2, max_tracked=3)
    for i in range(6):
        loads = {f"r{j}": (0 if j == i else 5) for j in range(6)}
        router.choose("ad", _fleet(6, loads))
    assert len(router.temporary_owners("ad")) <= 2
    for i in range(10):
        router.choose(f"b{i}", _fleet(6, {f"r{j}": 5 for j in range(6)}))
    assert len(router._temp) <= 3


def test_base_model_requests_go_least_loaded() -> None:
    views = _fleet(4, {"r0": 5, "r1": 2, "r2": 2, "r3": 7})
    for name in ("least_loaded", "affinity"):
        assert make_router(name).choose(None, views) == "r1"


def test_ray_default_prefers_replicas_with_the_model_loaded() -> None:
    router = RayDefaultRouter(seed=1)
    views = _fleet(8, host={"r5": frozenset({"ad"})}, pool={"r0": frozenset({"x"})})
    assert all(router.choose("ad", views) == "r5" for _ in range(20))
    # the only holder is full: falls back to the replicas with the fewest models (not r0, r5)
    full = _fleet(8, {"r5": 8}, host={"r5": frozenset({"ad"})}, pool={"r0": frozenset({"x"})})
    assert {router.choose("ad", full) for _ in range(50)} <= {f"r{i}" for i in (1, 2, 3, 4, 6, 7)}


@pytest.mark.parametrize("name", ["random", "ray_default"])
def test_seeded_routers_are_deterministic(name: str) -> None:
    views = _fleet(5, {"r2": 3})
    picks = [[make_router(name, seed=7).choose(f"a{i}", views) for i in range(30)] for _ in range(2)]
    assert picks[0] == picks[1]


def test_make_router_refuses_unknown_names_and_options() -> None:
    with pytest.raises(ValueError, match="router must be one of"):
        make_router("round_robin")
    with pytest.raises(ValueError, match="no options"):
        make_router("least_loaded", owners=3)
    with pytest.raises(ValueError, match="no live replica"):
        make_router("affinity").choose("a", [])

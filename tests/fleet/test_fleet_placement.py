"""The ``affinity_load`` router: owner count follows traffic share, owners judged by tokens in
flight and KV headroom, the pinned-bytes guard, pre-warms on growth."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lorapage.fleet.prewarm import JoinGate, PrewarmBox
from lorapage.fleet.routing import (
    DecayingCounts,
    LoadAffinityConfig,
    LoadAffinityRouter,
    Prewarm,
    ReplicaView,
    make_router,
    rendezvous_owners,
)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _views(n: int, **by_id: dict) -> list[ReplicaView]:
    """``n`` idle replicas of capacity 8; ``by_id`` maps a replica id to fields to set on it."""
    return [replace(ReplicaView(f"r{i}", 0, 8), **by_id.get(f"r{i}", {})) for i in range(n)]


def _router(clock: Clock, **kw: object) -> LoadAffinityRouter:
    return LoadAffinityRouter(clock, LoadAffinityConfig(**{"min_total": 10.0, **kw}))  # type: ignore[arg-type]


def test_decaying_counts_halve_every_half_life() -> None:
    counts = DecayingCounts(half_life_s=10.0, max_keys=2)
    for _ in range(4):
        counts.add("a", 0.0)
    assert counts.count("a", 10.0) == pytest.approx(2.0) and counts.total(20.0) == pytest.approx(1.0)
    counts.add("b", 0.0)
    counts.add("c", 0.0)  # a third key: the least recently counted one is forgotten
    assert counts.count("a", 0.0) == 0.0 and counts.count("c", 0.0) == 1.0


def test_owner_count_grows_with_share_and_shrinks_back() -> None:
    clock = Clock()
    router = _router(clock, min_owners=1, max_owners=6, owner_factor=2.0, half_life_s=5.0)
    views = _views(10)
    ids = [v.replica_id for v in views]
    assert router.owner_count("hot", 10) == 1  # never seen
    for i in range(20):  # hot takes every request: share 1 -> clamp(ceil(1 x 10 x 2)) = max_owners
        clock.now = i * 0.1
        router.choose("hot", views)
    assert router.owner_count("hot", 10) == 6
    assert router.owners("hot", ids) == rendezvous_owners("hot", ids, 6)
    for i in range(400):  # then others take the traffic for many half-lives: hot's share fades
        clock.now = 2.0 + i * 0.1
        router.choose(f"tail{i % 50}", views)
    assert router.owner_count("hot", 10) == 1
    # between the bounds k follows the share: one adapter of four equal ones on 10 replicas
    clock2 = Clock()
    even = _router(clock2, min_owners=1, max_owners=10, owner_factor=1.0)
    for i in range(200):
        clock2.now = i * 0.01
        even.choose(f"q{i % 4}", views)
    assert even.owner_count("q0", 10) == 3  # ceil(0.25 x 10 x 1)


def test_picks_the_owner_with_fewest_tokens_in_flight_not_requests() -> None:
    clock = Clock()
    router = _router(clock, min_owners=2, max_owners=2)
    ids = [f"r{i}" for i in range(6)]
    first, second = rendezvous_owners("a", ids, 2)
    # first has fewer requests but long ones; second more requests but fewer tokens
    views = _views(
        6, **{first: {"in_flight": 1, "tokens_in_flight": 6000}, second: {"in_flight": 4, "tokens_in_flight": 900}}
    )
    assert router.choose("a", views) == second
    # residency is worth tokens: holding the adapter in the pool outweighs a small token gap
    views = _views(
        6, **{first: {"tokens_in_flight": 1000, "pool": frozenset({"a"})}, second: {"tokens_in_flight": 600}}
    )
    assert router.choose("a", views) == first
    # an owner short of KV headroom counts as full: the other owner takes it despite more tokens
    views = _views(6, **{first: {"tokens_in_flight": 100, "kv_free": 0.01}, second: {"tokens_in_flight": 5000}})
    assert router.choose("a", views) == second
    assert router.spills == 0


def test_a_spill_goes_to_the_fleets_least_load_for_residency_and_its_replica_becomes_an_owner() -> None:
    clock = Clock()
    router = _router(clock, min_owners=2, max_owners=2, spill_owners=2, spill_ttl_s=60.0)
    ids = [f"r{i}" for i in range(5)]
    ranked = rendezvous_owners("a", ids, 5)
    full = {o: {"in_flight": 8} for o in ranked[:2]}
    # owners full: the fleet's lowest requests / capacity (not tokens), whatever its rank
    fields = full | {ranked[2]: {"in_flight": 5}, ranked[3]: {"in_flight": 6, "tokens_in_flight": 10}}
    fields |= {ranked[4]: {"in_flight": 3, "tokens_in_flight": 9000}}
    assert router.choose("a", _views(5, **fields)) == ranked[4]
    assert router.spills == 1 and router.spill_owners("a", ids) == [ranked[4]]
    # it is an owner now: the next request goes there while the rendezvous owners stay full, no spill
    fields[ranked[4]] = {"in_flight": 6}
    assert router.choose("a", _views(5, **fields)) == ranked[4] and router.spills == 1
    # a full replica holding the adapter in its pool beats an open one without it (0.25 of capacity)
    pooled = full | {ranked[4]: {"in_flight": 8}, ranked[3]: {"in_flight": 8, "pool": frozenset({"a"})}}
    pooled |= {ranked[2]: {"in_flight": 7}}
    assert router.choose("a", _views(5, **pooled)) == ranked[3]
    assert router.spills == 2 and router.spill_owners("a", ids) == [ranked[4], ranked[3]]
    # one that left the fleet is not named; unused for spill_ttl_s, a spill owner is forgotten
    assert router.spill_owners("a", [rid for rid in ids if rid != ranked[4]]) == [ranked[3]]
    clock.now = 61.0
    assert router.spill_owners("a", ids) == []
    assert router.owners("a", ids) == ranked[:2]


def test_pinned_bytes_guard_sends_new_adapters_elsewhere() -> None:
    clock = Clock()
    router = _router(clock, min_owners=2, max_owners=2, pinned_guard=0.8)
    ids = [f"r{i}" for i in range(4)]
    first, second = rendezvous_owners("a", ids, 2)
    guarded = {"pinned_bytes": 90, "adapter_room_bytes": 100}
    views = _views(4, **{first: guarded, second: {"tokens_in_flight": 4000}})
    assert router.choose("a", views) == second  # first is idle but past the guard
    # it still takes adapters it already holds
    views = _views(4, **{first: {**guarded, "host": frozenset({"a"})}, second: {"tokens_in_flight": 4000}})
    assert router.choose("a", views) == first
    # every replica past the guard: the request still goes somewhere
    assert router.choose("a", _views(4, **{r: guarded for r in ids})) in (first, second)
    assert router.guarded >= 2
    # every lora slot held by adapters smaller than a max-rank slot: few bytes, no slot left
    by_slots = {"pinned_bytes": 76, "adapter_room_bytes": 100, "held_slots": 4, "slots": 4}
    views = _views(4, **{first: by_slots, second: {"tokens_in_flight": 4000}})
    assert router.choose("a", views) == second


def test_prewarms_name_new_owners_when_the_owner_count_grows() -> None:
    clock = Clock()
    router = _router(clock, min_owners=1, max_owners=4, owner_factor=1.0)
    ids = [f"r{i}" for i in range(8)]
    ranked = rendezvous_owners("hot", ids, 4)
    views = _views(8, **{ranked[2]: {"pool": frozenset({"hot"})}})  # one future owner holds it already
    router.choose("hot", views)  # first sight: no growth, nothing to pre-warm
    assert router.take_prewarms() == []
    seen: list[Prewarm] = []
    for i in range(30):
        clock.now = i * 0.01
        router.choose("hot", views)
        seen += router.take_prewarms()
    assert router.owner_count("hot", 8) == 4
    assert {p.replica_id for p in seen} == {ranked[1], ranked[3]}  # new owners, less the one holding it
    assert all(p.adapter == "hot" for p in seen) and len(seen) == 2
    assert router.take_prewarms() == []  # taken once


def test_base_requests_go_to_fewest_tokens() -> None:
    router = _router(Clock())
    views = _views(
        3, r0={"tokens_in_flight": 500}, r1={"tokens_in_flight": 100, "in_flight": 5}, r2={"tokens_in_flight": 300}
    )
    assert router.choose(None, views) == "r1"


def test_make_router_builds_it_with_a_clock_and_checks_options() -> None:
    router = make_router("affinity_load", clock=Clock(), max_owners=3, seed=1)
    assert isinstance(router, LoadAffinityRouter) and router.config.max_owners == 3
    with pytest.raises(ValueError, match="needs a clock"):
        make_router("affinity_load")
    with pytest.raises(ValueError, match="affinity_load"):
        make_router("affinity_load", clock=Clock(), owners=3)
    with pytest.raises(ValueError, match="min_owners"):
        make_router("affinity_load", clock=Clock(), min_owners=5, max_owners=2)
    with pytest.raises(ValueError, match="no live replica"):
        make_router("affinity_load", clock=Clock()).choose("a", [])


def test_prewarm_box_hands_each_replica_its_own_once_and_stays_bounded() -> None:
    box = PrewarmBox(per_replica=2, max_replicas=2)
    for adapter in ("a", "b", "a", "c"):
        box.put("r0", adapter)
    box.put("r1", "x")
    assert box.take("r0") == ("a", "c")  # b was the oldest past the bound; a asked twice, once
    assert box.take("r0") == () and box.take("r9") == ()
    box.put("r2", "y")
    box.put("r3", "z")  # a third replica: the least recently asked one (r1) is forgotten
    assert box.take("r1") == () and box.take("r3") == ("z",)


def test_a_replica_that_joins_or_leaves_hands_the_busiest_adapters_to_their_new_owners() -> None:
    """Autoscaling's join and leave: the owners a changed replica set adds are named to pre-warm."""
    clock = Clock()
    router = _router(clock, min_owners=2, max_owners=2)
    views = _views(4)
    for i in range(40):
        router.choose(f"a{i % 20}", views)
    router.take_prewarms()
    before = [v.replica_id for v in views]
    after = [*before, "r9"]
    joined = router.handover(before, after, top=20)
    # Exactly the adapters whose owners now include the new replica, each named to it alone.
    owned = {f"a{i}" for i in range(20) if "r9" in rendezvous_owners(f"a{i}", after, 2)}
    assert owned and {p.adapter for p in joined} == owned and {p.replica_id for p in joined} == {"r9"}
    # It leaves again: the replicas that now own its adapters warm them; nothing else moves.
    left = router.handover(after, before, top=20)
    assert {p.adapter for p in left} == owned and "r9" not in {p.replica_id for p in left}
    assert router.handover(before, before) == []


def test_a_joining_replica_is_held_from_traffic_until_its_prewarms_are_resident() -> None:
    """The join sequence's last step: traffic once the handed-over adapters are in its pool, or
    its pre-warm loads settled (a pool too small for them all, a failed load), or after the
    timeout (a replica that never reports); one handed nothing serves at once."""
    clock = Clock()
    gate = JoinGate(clock, timeout_s=30.0)
    gate.join("r1", ["a@1", "b@1"])
    gate.join("r2", [])
    pools = {"r0": frozenset({"a@1", "b@1"}), "r1": frozenset({"a@1"}), "r2": frozenset()}
    assert gate.warming(pools, {}) == {"r1"}  # b@1 not resident yet; r2 had nothing to warm
    assert gate.warming(pools, {"r1": 1}) == {"r1"}  # one of its two loads settled
    assert gate.warming({**pools, "r1": frozenset({"a@1", "a", "b@1"})}, {}) == frozenset()
    assert gate.warming(pools, {}) == frozenset()  # let through once and for all, whatever it evicts later
    gate.join("r3", ["c@1", "d@1"])
    assert gate.warming({**pools, "r3": frozenset({"d@1"})}, {"r3": 2}) == frozenset()  # c@1 evicted or failed
    gate.join("r3", ["c@1"])
    clock.now = 29.0
    assert gate.warming({**pools, "r3": frozenset()}, {}) == {"r3"}
    clock.now = 30.0
    assert gate.warming({**pools, "r3": frozenset()}, {}) == frozenset()  # it never reported: it serves
    gate.join("r4", ["c@1"])
    assert gate.warming(pools, {}) == frozenset()  # r4 left before it warmed: forgotten

"""What the traffic tiers do to residency (lorapage.adapters.residency, no torch, time an argument):
hot versions kept resident within the pins' bounds and never ahead of an admin pin; warm ones
prefetched into host RAM."""

from __future__ import annotations

from test_residency import make_resident, rules

from lorapage.adapters.decisions import Evict, Prefetch, Read, Yield
from lorapage.adapters.pins import PinBounds
from lorapage.adapters.residency import TIERS_TENANT
from lorapage.adapters.value import LoadTier


def test_hot_versions_are_kept_resident_within_the_pins_bounds_most_requested_first():
    bounds = PinBounds(capacity=99, max_resident_loras=4, max_pinned_fraction=0.25)  # 24 pages, 3 adapters
    r = rules(slots=4, pages=100, pins=bounds)
    for key in ("a", "b", "c", "d"):
        r.add(key, pages=10)
    # a, b, c are hot in that order: a and b fit (20 pages), c would pass 24 pages.
    assert r.set_hot(["a", "b", "c"]) == [Read("a", LoadTier.DISK), Read("b", LoadTier.DISK)]
    assert r.pins.hot() == ["a", "b"] and not r.get("c").hot
    assert r.pins.pinned_pages() == 0  # the admin's pins: none
    for key in ("a", "b", "c", "d"):
        if key in ("c", "d"):
            r.enqueue(key, 0.0)
        r.read_done(key, 0.0)
    for key in ("a", "b", "c", "d"):
        r.copy_done(key, r.get(key).slot, True, 0.0)
    for key in ("c", "d"):
        r.admit(key, 0.0)
    # a is idle and the least valuable (no request), but kept: a starving load makes c or d yield.
    r.add("e", pages=10)
    r.enqueue("e", 5.0)
    r.read_done("e", 5.0)
    assert r.tick(7.0) in ([Yield("c")], [Yield("d")])
    assert r.reclaim(r.pages.num_free + 30, 7.0) == []  # nothing idle but a and b, which stay
    # a is hot no more: evictable by value again (its host copy stays).
    r.set_hot(["b"])
    assert r.pins.hot() == ["b"]
    assert [d.key for d in r.reclaim(r.pages.num_free + 10, 8.0) if isinstance(d, Evict)] == ["a"]


def test_an_admin_pin_takes_the_room_of_hot_versions_least_requested_first():
    bounds = PinBounds(capacity=99, max_resident_loras=8, max_pinned_fraction=0.25)  # 24 pages
    r = rules(slots=8, pages=100, pins=bounds)
    for key in ("a", "b", "p"):
        r.add(key, pages=10)
    r.set_hot(["a", "b"])
    assert r.pins.hot() == ["a", "b"]
    r.pin("p")  # checked against the admin pins alone (10 of 24): granted
    assert r.pins.pinned() == ["p"] and r.pins.hot() == ["a"]  # b, the less requested, was let go
    # Hot again next time: only the room the admin pins leave.
    r.set_hot(["b", "a"])
    assert r.pins.hot() == ["b"]
    # A version an admin pinned is held by its pin, not counted twice.
    r.set_hot(["p", "a"])
    assert r.pins.hot() == ["a"] and r.get("p").pinned


def test_no_room_for_pins_keeps_no_hot_version():
    r = rules(slots=4, pages=100, pins=PinBounds(capacity=99, max_resident_loras=4, max_pinned_fraction=0.0))
    r.add("a", pages=10)
    assert r.set_hot(["a"]) == [] and r.pins.hot() == []
    r = rules(slots=4, pages=100, pins=None)  # pins not enabled
    r.add("a", pages=10)
    assert r.set_hot(["a"]) == [] and r.pins.hot() == []


def test_warm_versions_are_prefetched_into_host_ram_under_the_tiers_share():
    r = rules(slots=2, host=6, pages=100, prefetches=2)
    for key in ("a", "b", "c", "d", "e"):
        r.add(key, pages=10)
    make_resident(r, "e", 0.0)
    # e is resident and so left alone; of host RAM's 6, warm copies may take 3: a, b, c; one at a time.
    assert r.prewarm(["e", "a", "b", "c", "d"]) == [Prefetch("a", TIERS_TENANT)]
    assert list(r.prefetch.waiting) == ["b"]  # d is past half of host RAM, e resident
    assert r.prefetch_done("a", True) == [Prefetch("b", TIERS_TENANT)]
    r.prefetch_done("b", True)
    assert set(r.host.keys()) >= {"a", "b"} and not r.is_resident("a")
    assert r.prewarm(["a", "b"]) == []  # in host RAM already

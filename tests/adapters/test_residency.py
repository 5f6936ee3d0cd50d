"""The residency rules on their own (lorapage.adapters.residency): no torch, no threads, the time an
argument. Each test plays the loader's part by hand: it reports reads and copies done and checks
the decisions that come back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lorapage.adapters.decisions import Cancel, DropHost, Evict, Load, Prefetch, Read, Ready, Release, Yield
from lorapage.adapters.pins import PinBounds
from lorapage.adapters.residency import Residency, ResidencyLimits
from lorapage.adapters.value import LoadTier, ReloadCosts
from lorapage.errors import AdapterBusyError, ConflictError, PinLimitError
from lorapage.memory.pages import PageAllocator, PageKind
from lorapage.memory.prefix_cache import PrefixCache, block_keys
from lorapage.memory.reclaim import Reclaim, RecomputeCost

WAIT_S = 1.0


def rules(
    *,
    slots: int = 2,
    host: int = 4,
    pages: int = 200,
    prefetches: int = 0,
    pins: PinBounds | None = None,
    host_bytes: int | None = None,
) -> Residency:
    pool = PageAllocator(pages)
    limits = ResidencyLimits(
        slots, host, adapter_wait_s=WAIT_S, max_prefetches=prefetches, pins=pins, max_cpu_lora_bytes=host_bytes
    )
    return Residency(limits, pool, Reclaim(pool), ReloadCosts(page_bytes=1 << 20))


def make_resident(r: Residency, key: str, now: float, *, requests: int = 1) -> None:
    """``requests`` requests for ``key`` arrive, its load runs, and they are admitted."""
    for _ in range(requests):
        r.enqueue(key, now)
    decisions = r.read_done(key, now)
    load = next(d for d in decisions if isinstance(d, Load))
    assert r.copy_done(key, load.slot, True, now) == [Ready(key)]
    for _ in range(requests):
        r.admit(key, now)


def test_a_load_reads_then_takes_a_free_slot_and_its_pages():
    r = rules()
    r.add("a", pages=10)
    assert r.enqueue("a", 0.0) == [Read("a", LoadTier.DISK)]
    assert r.tier("a") == "disk" and not r.is_ready("a")
    (load,) = r.read_done("a", 0.5)
    assert isinstance(load, Load) and load.slot == 1 and len(load.pages) == 10
    assert r.tier("a") == "ram"  # its host copy is there; the copy into the pool is not done
    assert r.copy_done("a", load.slot, True, 0.6) == [Ready("a")]
    assert r.is_ready("a") and r.tier("a") == "gpu" and r.slots.resident_pages() == {"a": 10}


def test_host_copies_leave_by_lru_when_their_bytes_pass_the_bound():
    """max_cpu_lora_bytes 100 with room for 8 copies by count: bytes bind. Each read lands a copy;
    the least recently used leave until the rest fit, whatever their count, and a copy used again
    moves to the back of the line."""
    r = rules(slots=8, host=8, host_bytes=100)
    for key, size in (("a", 40), ("b", 30), ("c", 20), ("d", 50), ("e", 120)):
        r.add(key, pages=1, host_bytes=size)
    for key in ("a", "b", "c"):
        make_resident(r, key, 0.0)
    assert r.host.keys() == ["a", "b", "c"] and r.host.nbytes == 90
    r.enqueue("d", 1.0)
    assert r.read_done("d", 1.0)[0] == DropHost("a")  # 90 + 50 > 100: a leaves, 100 fit
    assert r.host.keys() == ["b", "c", "d"] and r.host.nbytes == 100
    r.prefetch_done("b", True)  # b's copy used again: the most recent now
    assert r.host.keys() == ["c", "d", "b"]
    # A copy larger than the whole bound leaves alone: what was there stays.
    r.enqueue("e", 2.0)
    assert r.read_done("e", 2.0)[0] == DropHost("e")
    assert r.host.keys() == ["c", "d", "b"] and r.host.nbytes == 100
    r.finish("c")
    assert DropHost("c") in r.remove("c", 3.0) and r.host.keys() == ["d", "b"] and r.host.nbytes == 80


def test_the_idle_adapter_of_least_value_per_page_leaves_for_a_load():
    """Equal rates: the one whose host copy is kept (a copy back) goes before one that would need
    a read; otherwise the least used per page."""
    r = rules(slots=2, host=2)
    for key in ("a", "b", "c"):
        r.add(key, pages=5)
    for key in ("a", "b"):
        make_resident(r, key, 0.0)
        r.finish(key)
    r.enqueue("c", 0.0)
    decisions = r.read_done("c", 0.0)
    assert decisions == [DropHost("a"), Evict("b", 2), Load("c", 2, decisions[-1].pages)]
    # Later, a has two requests and c one: c leaves, less used and only a copy away.
    r.copy_done("c", 2, True, 0.0)
    r.admit("c", 0.0)
    r.finish("c")
    r.enqueue("a", 10.0)
    r.admit("a", 10.0)
    r.finish("a")
    r.add("d", pages=5)
    r.enqueue("d", 20.0)
    assert [d for d in r.read_done("d", 20.0) if isinstance(d, Evict)] == [Evict("c", 2)]


def test_a_starving_load_makes_the_least_valuable_busy_adapter_yield_after_adapter_wait_s():
    r = rules(slots=2)
    for key, rate in (("a", 3), ("b", 1)):
        r.add(key, pages=5)
        make_resident(r, key, 0.0, requests=rate)
    r.add("c", pages=5)
    r.enqueue("c", 2.0)
    assert r.read_done("c", 2.0) == []  # every slot busy: patient
    assert r.loads.next_check(2.0) == 2.0 + WAIT_S
    assert r.tick(2.5) == []
    assert r.tick(3.0) == [Yield("b")]  # b has the fewest requests per page
    assert not r.is_ready("b") and r.is_ready("a")
    assert r.loads.pending_pages() == 5  # KV admission leaves c's pages free meanwhile
    r.finish("b")  # its running request ends: it is idle of running ones, and c takes its slot
    decisions = r.tick(3.1)
    assert decisions[:1] == [Evict("b", 2)] and isinstance(decisions[1], Load) and decisions[1].slot == 2
    assert r.loads.yields == 1 and not r.get("b").yielding


def test_an_adapter_resident_less_than_adapter_wait_s_is_spared_and_the_line_keeps_its_order():
    r = rules(slots=1)
    r.add("a", pages=5)
    make_resident(r, "a", 10.0)
    for key, at in (("b", 5.0), ("c", 6.0)):
        r.add(key, pages=5)
        r.enqueue(key, at)
        r.read_done(key, at)
    assert r.tick(10.5) == []  # both starving, but a became resident half a second ago
    assert r.loads.next_check(10.5) == 10.0 + WAIT_S  # when it may yield
    assert r.tick(11.0) == [Yield("a")]
    r.finish("a")
    decisions = r.tick(11.0)
    assert [type(d) for d in decisions] == [Evict, Load] and decisions[1].key == "b"  # first in line
    r.copy_done("b", 1, True, 11.0)
    r.admit("b", 11.0)
    assert r.tick(11.5) == []  # c waits: b is spared for adapter_wait_s
    assert r.tick(12.0) == [Yield("b")]


def test_a_version_loaded_for_a_queued_request_keeps_its_slot_until_it_has_served():
    """Its turn starts at its first admission, not when its copy lands, and again when a
    preemption leaves nothing running on it: a request whose admission waits on KV room longer
    than adapter_wait_s (a loaded machine) is served before the version yields, rather than the
    version being evicted unserved and the slot cycling."""
    r = rules(slots=1)
    r.add("a", pages=5)
    make_resident(r, "a", 0.0)
    r.add("b", pages=5)
    r.enqueue("b", 0.0)
    r.read_done("b", 0.0)
    assert r.tick(1.0) == [Yield("a")]
    r.finish("a")
    r.enqueue("a", 1.0)  # a's traffic goes on: it starves in its turn
    assert [type(d) for d in r.tick(1.0)] == [Evict, Read, Load]
    r.read_done("a", 1.0)
    r.copy_done("b", 1, True, 1.0)
    assert r.tick(5.0) == [] and r.loads.next_check(5.0) is None  # b's request is not admitted yet
    r.admit("b", 5.0)
    r.requeue("b")  # preempted for KV room before its first token: its turn starts again
    assert r.tick(7.0) == [] and r.loads.next_check(7.0) is None
    r.admit("b", 7.0)
    assert r.loads.next_check(7.0) == 7.0 + WAIT_S
    assert r.tick(7.5) == []
    assert r.tick(8.0) == [Yield("b")]


def test_a_prewarm_waits_for_a_slot_without_making_an_adapter_yield():
    r = rules(slots=1)
    r.add("a", pages=5)
    make_resident(r, "a", 0.0)
    r.add("b", pages=5)
    assert r.ensure("b") == [Read("b", LoadTier.DISK)]
    r.read_done("b", 0.0)
    assert r.tick(100.0) == [] and r.loads.yields == 0
    r.finish("a")
    assert [type(d) for d in r.tick(100.0)] == [Evict, Load]


def test_pins_are_never_evicted_nor_made_to_yield_and_are_bounded():
    bounds = PinBounds(capacity=99, max_resident_loras=3, max_pinned_fraction=0.2)
    r = rules(slots=3, pages=100, pins=bounds)
    for key in ("a", "b", "c", "d"):
        r.add(key, pages=10)
    r.pin("a")
    make_resident(r, "a", 0.0)
    r.finish("a")
    with pytest.raises(ConflictError):
        r.unload("a", 0.0)
    with pytest.raises(PinLimitError, match="asks for 10 pages; pins hold 10 pages and may hold 19"):
        r.pin("b")
    assert r.pins.limit() == 19 and r.pins.pinned_pages() == 10
    make_resident(r, "b", 0.0)
    make_resident(r, "c", 0.0)
    r.enqueue("d", 5.0)
    r.read_done("d", 5.0)
    assert r.tick(6.0) == [Yield("b")]  # a is idle and the least used, but pinned
    assert r.reclaim(r.pages.num_free + 20, 6.0) == []  # nothing idle but a, which stays


def test_a_copy_whose_adapter_was_removed_gives_its_slot_and_pages_back_only_when_done():
    r = rules(slots=1, pages=50)
    r.add("a", pages=10)
    r.enqueue("a", 0.0)
    (load,) = r.read_done("a", 0.0)
    with pytest.raises(AdapterBusyError):
        r.remove("a", 0.0)
    r.dequeue("a")
    assert r.remove("a", 0.0) == [DropHost("a")]
    assert r.pages.num_free == 49 - 10 and r.slots.num_free == 0  # the copy may still write them
    assert r.copy_done("a", load.slot, True, 0.1) == [Release("a", load.slot)]
    assert r.pages.num_free == 49 and r.slots.num_free == 1


def test_a_failed_copy_gives_back_its_slot_and_a_later_request_retries():
    r = rules(slots=1, pages=50)
    r.add("a", pages=10)
    r.enqueue("a", 0.0)
    (load,) = r.read_done("a", 0.0)
    assert r.copy_done("a", load.slot, False, 0.1) == [Release("a", load.slot)]
    assert r.pages.num_free == 49 and r.loads.loading() == []
    r.dequeue("a")
    assert r.enqueue("a", 1.0) == [Read("a", LoadTier.RAM)]  # its host copy was kept


def test_prefetch_waits_for_the_load_reading_and_a_load_joins_a_prefetch():
    r = rules(slots=4, prefetches=1)
    for key in ("a", "b", "c", "far"):
        r.add(key, pages=5, cold=LoadTier.REMOTE if key == "far" else LoadTier.DISK)
    for key in ("b", "c", "far"):  # tenant t used these lately (none loaded: all cold)
        r.recent.use("t", key, 0.0)
    assert r.enqueue("a", 1.0, tenant="t") == [Read("a", LoadTier.DISK)]  # nothing may read beside it
    decisions = r.read_done("a", 1.5)
    assert decisions[0] == Prefetch("c", "t") and isinstance(decisions[1], Load)  # most recent first
    assert "far" not in r.prefetch.waiting  # no downloads on speculation
    assert r.enqueue("c", 2.0, tenant="u") == []  # joins the prefetch in flight
    assert r.prefetch_done("c", True) == [Read("c", LoadTier.DISK), Prefetch("b", "t")]
    assert r.tier("c") == "ram" and r.prefetch.counts["done"] == 1


def test_remove_cancels_a_read_and_forgets_the_adapter():
    r = rules()
    r.add("a", pages=5)
    r.enqueue("a", 0.0)
    r.dequeue("a")
    assert r.remove("a", 0.0) == [Cancel("a")]
    assert "a" not in r.adapters and r.loads.loading() == []


def test_one_ranking_gives_back_cached_blocks_and_adapters_cheapest_per_page_first():
    """A never-hit block (rate 1) is worth less than a page of an adapter used as often whose reload
    costs more than recomputing the block; a block hit fifty times is worth more."""
    pool = PageAllocator(40)
    blocks = PrefixCache(pool, clock=lambda: 0.0)
    recompute = RecomputeCost(page_bytes=1 << 20, block_size=4)
    costs = ReloadCosts(page_bytes=1 << 20)
    # No host RAM: the adapter falls to disk, a read and a copy away.
    r = Residency(ResidencyLimits(2, 0, WAIT_S), pool, Reclaim(pool, blocks, recompute), costs)
    r.add("a", pages=10)
    make_resident(r, "a", 0.0)
    r.finish("a")
    cold, hot = (block_keys(tag, list(range(4)), 4) for tag in (b"cold", b"hot"))
    for keys, uses in ((cold, 1), (hot, 50)):
        page = pool.allocate(1, PageKind.KV)
        assert page is not None
        blocks.offer(keys[0], page[0])
        blocks.release(list(page))
        for _ in range(uses - 1):
            blocks.release(blocks.match(keys))
    adapter_value = r.slots.value_per_page(r.get("a"), 0.0)
    assert recompute.block_s() < adapter_value < 50 * recompute.block_s()  # what the order below relies on
    assert r.reclaim(pool.num_free + 1, 0.0) == []  # the cold block was enough
    assert blocks.num_cached == 1
    assert r.reclaim(pool.num_free + 1, 0.0) == [Evict("a", 1)]  # then the adapter, before the hot block
    assert blocks.num_cached == 1


def test_the_cache_forwards_nothing_to_the_residency_and_no_part_grows_past_forty_methods():
    """Layer (a) of the control plane: the residency decides, the cache carries its decisions out.
    Readers ask the residency (or its parts) directly, so no cache method's whole body is the
    residency's method of the same name; and the rules stay split along their tiers."""
    root = Path(__file__).resolve().parents[2] / "lorapage" / "adapters"
    modules = ("cache", "checks", "residency", "residence", "pool_slots", "host_ram", "loads", "pins", "prefetch")
    for module in modules:
        tree = ast.parse((root / f"{module}.py").read_text())
        for cls in (c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)):
            methods = [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            assert len(methods) <= 40, f"{module}.{cls.name} has {len(methods)} methods"
            for f in methods:
                body = [s for s in f.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                call = body[0].value if len(body) == 1 and isinstance(body[0], (ast.Return, ast.Expr)) else None
                forwards = (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == f.name
                    and isinstance(call.func.value, ast.Attribute)
                )
                assert not forwards, f"{module}.{cls.name}.{f.name} only forwards to a part"

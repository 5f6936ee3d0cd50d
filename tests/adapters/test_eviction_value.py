"""One eviction ranking for idle cached KV blocks and idle adapters: value per page = use rate x
the seconds losing it costs (a block's recompute, an adapter's reload) / pages. Hot prefixes
outlive cold adapters, cold blocks go before warm adapters, children before their parents, in
an order the injected clock fixes; the books balance; outputs do not change."""

from __future__ import annotations

import random

import torch
from engine_util import collect

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.adapters.value import Stage
from lorapage.memory.pages import PageKind
from lorapage.memory.pool import PagePool
from lorapage.memory.prefix_cache import HIT_HALF_LIFE_S, PrefixCache, block_keys
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

PROMPT = [5, 9, 12, 30]
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)
BS = 4  # block size of every engine here


class FrozenClock:
    """The injected clock, moved by hand: rates decay only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_with(clock: FrozenClock, **overrides) -> Engine:
    """The tiny engine, caching off: the tests place the idle blocks themselves."""
    cfg = dict(
        model=str(TINY_BASE_DIR),
        max_loras=4,
        max_resident_loras=4,
        max_lora_rank=64,
        block_size=BS,
        enable_prefix_caching=False,
    )
    cfg.update(overrides)
    engine = Engine(EngineConfig(**cfg), clock=clock)
    for name, path in demo_adapter_dirs().items():
        engine.add_adapter(name, path)
    return engine


def set_costs(engine: Engine, *, reload_s: float, block_s: float) -> None:
    """Feed the EWMAs until an adapter page costs ``reload_s`` to reload from host RAM or disk
    alike and a block ``block_s`` to recompute (what timed loads and prefills would teach them)."""
    for _ in range(200):
        engine.debug.adapters.costs.observe(Stage.COPY, reload_s, 1)
        engine.debug.adapters.costs.observe(Stage.READ, 0.0, 1)
        engine.debug.reclaim.recompute.observe(block_s, BS)


def idle_chain(cache: PrefixCache, pool: PagePool, tag: bytes, blocks: int, uses: int) -> list[int]:
    """``blocks`` chained blocks computed now by one sequence and hit ``uses - 1`` more times
    now, all idle after; their pages, root first."""
    keys = block_keys(tag, list(range(blocks * BS)), BS)
    pages = pool.allocate(blocks, PageKind.KV)
    assert pages is not None
    for key, page in zip(keys, pages):
        cache.offer(key, page)
    cache.release(list(pages))
    for _ in range(uses - 1):
        assert cache.match(keys) == pages
        cache.release(list(pages))
    return pages


def evict_one_page(engine: Engine) -> list[str]:
    """Ask for one page more than is free; what left the pool (adapter names, or ``page N``)."""
    cached, resident = set(engine.debug.prefix_cache._key), set(engine.debug.residency.slots.resident())
    assert engine.debug.adapters.room_for_kv(engine.debug.pool.num_free + 1, reserve=False)
    gone = sorted(resident - set(engine.debug.residency.slots.resident()))
    return gone + [f"page {p}" for p in sorted(cached - set(engine.debug.prefix_cache._key))]


async def test_a_hot_prefix_outlives_a_cold_adapter():
    clock = FrozenClock()
    engine = engine_with(clock)
    try:
        await collect(engine, PROMPT, "globex", SHORT)
        clock.now += 10 * HIT_HALF_LIFE_S  # globex's one request is old now
        set_costs(engine, reload_s=1.0, block_s=1.0)
        hot = idle_chain(engine.debug.prefix_cache, engine.debug.pool, b"hot", blocks=3, uses=10)
        assert evict_one_page(engine) == ["globex@1"]
        assert engine.debug.prefix_cache.num_cached == engine.debug.prefix_cache.num_idle == len(hot)
        assert engine.stats().prefix_cache_evicted_blocks == 0
    finally:
        await engine.close()


async def test_a_cold_never_hit_block_goes_before_a_warm_adapter():
    clock = FrozenClock()
    engine = engine_with(clock)
    try:
        cold = idle_chain(engine.debug.prefix_cache, engine.debug.pool, b"cold", blocks=1, uses=1)
        clock.now += 10 * HIT_HALF_LIFE_S
        for _ in range(3):
            await collect(engine, PROMPT, "globex", SHORT)
        set_costs(engine, reload_s=1.0, block_s=1.0)
        assert evict_one_page(engine) == [f"page {cold[0]}"]
        assert (
            engine.debug.residency.slots.resident() == ["globex@1"] and engine.stats().prefix_cache_evicted_blocks == 1
        )
    finally:
        await engine.close()


async def test_blocks_and_adapters_interleave_by_value_per_page_leaves_first():
    """Values per page at one instant: chain x (two blocks, one use) 1.0 each, acme (one
    request) 1.5, y (two uses) 2.0, globex (two requests) 3.0, z (four uses) 4.0."""
    clock = FrozenClock()
    engine = engine_with(clock)
    try:
        await collect(engine, PROMPT, "acme", SHORT)
        for _ in range(2):
            await collect(engine, PROMPT, "globex", SHORT)
        set_costs(engine, reload_s=1.5, block_s=1.0)
        cache, pool = engine.debug.prefix_cache, engine.debug.pool
        z = idle_chain(cache, pool, b"z", blocks=1, uses=4)
        x = idle_chain(cache, pool, b"x", blocks=2, uses=1)
        y = idle_chain(cache, pool, b"y", blocks=1, uses=2)
        order = [evict_one_page(engine) for _ in range(6)]
        assert order == [
            [f"page {x[1]}"],  # the leaf before its parent (equal value)
            [f"page {x[0]}"],
            ["acme@1"],
            [f"page {y[0]}"],
            ["globex@1"],
            [f"page {z[0]}"],
        ]
        assert cache.num_cached == 0 and engine.stats().prefix_cache_evicted_blocks == 4
    finally:
        await engine.close()


def test_a_child_never_outranks_its_parent_and_max_rate_stops_the_run():
    """Blocks computed one step apart: the later child would score higher than its parent on
    its own, but goes first; ``max_rate`` keeps blocks used more often than it."""
    clock = FrozenClock()
    pool = PagePool(1, 10, 8, torch.float32, torch.device("cpu"))
    cache = PrefixCache(pool, clock)
    keys = block_keys(b"ns", list(range(3 * BS)), BS)
    pages = pool.allocate(3, PageKind.KV)
    assert pages is not None
    for key, page in zip(keys, pages):
        cache.offer(key, page)
        clock.now += 1.0
    cache.release(list(pages))
    assert cache.evict(pool.num_free + 1, max_rate=0.1) == 0  # each was used once lately: rate ~1
    assert cache.evict(pool.num_free + 2) == 2
    assert cache.match(keys) == pages[:1]  # the root is what is left
    cache.release(pages[:1])
    assert cache.num_cached == cache.num_idle == 1 and pool.num_free == pool.capacity - 1


def test_only_counted_matches_raise_a_blocks_rate():
    """An admission that fails gives back its match uncounted: however often it retries, the
    block keeps its rank; a use counted once the request runs lifts it."""
    clock = FrozenClock()
    pool = PagePool(1, 10, 8, torch.float32, torch.device("cpu"))
    cache = PrefixCache(pool, clock)
    old, new = (block_keys(tag, list(range(BS)), BS) for tag in (b"old", b"new"))
    for keys in (old, new):
        page = pool.allocate(1, PageKind.KV)
        assert page is not None
        cache.offer(keys[0], page[0])
        cache.release(page)
        clock.now += 1.0
    for _ in range(5):
        cache.release(cache.match(old, count=False))
    assert cache.evict(pool.num_free + 1) == 1 and cache.match(old) == [] and cache.num_cached == 1
    cache.clear()
    for keys in (old, new):
        page = pool.allocate(1, PageKind.KV)
        assert page is not None
        cache.offer(keys[0], page[0])
        cache.release(page)
        clock.now += 1.0
    held = cache.match(old, count=False)
    cache.count_uses(held)
    cache.release(held)
    assert cache.evict(pool.num_free + 1) == 1 and cache.match(new) == [] and cache.num_cached == 1


def test_books_balance_over_random_offers_hits_releases_and_evictions():
    """A random mix of sequences (sharing prefixes from a few chains), releases and evictions
    under a moving clock: refcounts, idle counts and pool counts agree with a plain model, and
    no cached block ever outlives its parent (eviction takes leaves first)."""
    rng = random.Random(7)
    clock = FrozenClock()
    pool = PagePool(1, 64, 8, torch.float32, torch.device("cpu"))
    cache = PrefixCache(pool, clock)
    chains = [block_keys(bytes([c]), [rng.randrange(100) for _ in range(8 * BS)], BS) for c in range(5)]
    parent = {k: (chain[i - 1] if i else None) for chain in chains for i, k in enumerate(chain)}
    live: list[list[int]] = []  # block tables of the sequences holding pages
    offered = 0
    for _ in range(2000):
        clock.now += rng.expovariate(1.0) * 5
        op = rng.random()
        if op < 0.45:
            keys = rng.choice(chains)[: rng.randint(1, 8)]
            table = cache.match(keys)
            own = pool.allocate(len(keys) - len(table), PageKind.KV)
            if own is None:
                cache.release(table)
                continue
            for key, page in zip(keys[len(table) :], own):
                cache.offer(key, page)
                offered += 1
            live.append(table + own)
        elif op < 0.85 and live:
            cache.release(live.pop(rng.randrange(len(live))))
        else:
            cache.evict(pool.num_free + rng.randint(1, 8), max_rate=rng.choice([0.01, 0.1, 1.0, float("inf")]))
        holders: dict[int, int] = {}
        for table in live:
            for page in table:
                holders[page] = holders.get(page, 0) + 1
        assert set(cache._refs) == {p for p in holders if p in cache._key}
        assert all(cache._refs[p] == n for p, n in holders.items() if p in cache._refs)
        assert cache.num_idle == cache.num_cached - len(cache._refs)
        own = sum(1 for table in live for page in table if page not in cache._key)  # one holder each
        assert pool.used[PageKind.KV] == cache.num_cached + own
        assert pool.num_free + pool.used[PageKind.KV] == pool.capacity
        assert cache.evicted == offered - cache.num_cached
        assert all(parent[k] is None or parent[k] in cache._page for k in cache._page)
    for table in live:
        cache.release(table)
    cache.clear()
    assert cache.num_cached == 0 and pool.num_free == pool.capacity and not cache._heap


async def test_outputs_match_caching_off_when_blocks_and_adapters_are_both_evicted():
    """acme (37 pages) and globex (6) share a pool with 46 KV pages: old prefixes and globex,
    idle and cheap to reload against a slow recompute, both give way, and every greedy answer
    is the uncached one."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    system = [(7 * j) % 200 + 3 for j in range(24)]
    prompts = [system + [(11 * k + j) % 200 + 3 for j in range(24)] for k in range(5)]
    plan = [("acme", 0), ("globex", 1), ("acme", 2), ("acme", 0), ("acme", 3), ("globex", 1), ("acme", 4)]
    plan += [("acme", 2), ("globex", 4), ("acme", 1), ("acme", 0)]

    async def run(caching: bool) -> tuple[list[list[int]], Engine]:
        clock = FrozenClock()
        cfg = EngineConfig(
            model=str(TINY_BASE_DIR),
            block_size=BS,
            num_pages=1 + 37 + 46,
            max_num_seqs=2,
            max_model_len=184,
            max_loras=4,
            max_resident_loras=4,
            enable_prefix_caching=caching,
        )
        engine = Engine(cfg, clock=clock)
        for name in ("acme", "globex"):
            engine.add_adapter(name, demo_adapter_dirs()[name])
        for _ in range(50):  # a slow prefill (2.5 ms per token), so a block outweighs a cold adapter page
            engine.debug.reclaim.recompute.observe(0.01, BS)
        outs = []
        for adapter, k in plan:
            clock.now += 2 * HIT_HALF_LIFE_S
            outs.append((await collect(engine, prompts[k], adapter, params))[0].token_ids)
        return outs, engine

    expected, off = await run(False)
    await off.close()
    got, engine = await run(True)
    try:
        assert got == expected
        stats = engine.stats()
        assert stats.prefix_cache_evicted_blocks > 0 and sum(engine.debug.adapter_metrics.evictions.values()) > 0
        assert stats.prefix_cache_hit_rate > 0
        assert engine.debug.reclaim.recompute.measured > 50  # the step loop fed each prefill's timing too
        cache, pool = engine.debug.prefix_cache, engine.debug.pool
        assert pool.used[PageKind.KV] == cache.num_idle == cache.num_cached  # nothing running: all idle
        assert pool.num_free + cache.num_idle + pool.used[PageKind.ADAPTER] == pool.capacity
    finally:
        await engine.close()

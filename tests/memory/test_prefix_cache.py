"""Prefix caching: full KV blocks reused by content within one base and one adapter registration,
never across adapters, registrations or the base, nor across tenants outside one prefix group;
idle cached blocks given back under pressure; outputs identical with caching on and off (and to
transformers + peft)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_util import collect, tiny_engine
from hf_reference import make_peft_adapter, make_random_llama, peft_greedy

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.config import DEFAULT_TENANT
from lorapage.memory.pages import PageKind
from lorapage.memory.pool import PagePool
from lorapage.memory.prefix_cache import PrefixCache, block_keys
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
SYSTEM = list(range(3, 35))  # 32 tokens: 8 blocks of 4 shared by every turn


def test_keys_chain_and_depend_on_the_namespace():
    a = block_keys(b"base", list(range(12)), 4)
    assert len(a) == 3 and a == block_keys(b"base", list(range(13)), 4)  # a partial block has no key
    assert block_keys(b"base", list(range(8)), 4) == a[:2]
    assert block_keys(b"base", list(range(8, 12)), 4, parent=a[1]) == a[2:]  # continuing a chain
    assert set(a).isdisjoint(block_keys(b"adapter", list(range(12)), 4))
    assert block_keys(b"base", [9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]  # the chain: same block, other parent


def test_refcounts_idle_blocks_and_eviction():
    pool = PagePool(1, 10, 8, torch.float32, torch.device("cpu"))
    cache = PrefixCache(pool)
    keys = block_keys(b"ns", list(range(12)), 4)
    first = pool.allocate(3, PageKind.KV)
    for key, page in zip(keys, first):
        cache.offer(key, page)
    second = cache.match(keys[:2])
    assert second == first[:2] and cache.num_cached == 3 and cache.num_idle == 0
    table = list(first)
    cache.release(table)  # the first sequence is done: block 2 is idle, blocks 0-1 still held
    assert table == [] and cache.num_idle == 1 and pool.num_free == 9 - 3
    cache.release(second)
    assert cache.num_idle == 3 and pool.used[PageKind.KV] == 3
    assert cache.match(keys) == first and cache.num_idle == 0  # idle blocks are hits too
    cache.release(list(first))
    assert cache.evict(pool.num_free + 2) == 2 and cache.num_cached == 1  # lowest use rate first, leaves first
    cache.clear()
    assert cache.num_cached == 0 and pool.num_free == 9


def test_a_duplicate_block_stays_its_sequences_own():
    pool = PagePool(1, 10, 8, torch.float32, torch.device("cpu"))
    cache = PrefixCache(pool)
    key = block_keys(b"ns", [1, 2, 3, 4], 4)[0]
    a, b = pool.allocate(1, PageKind.KV), pool.allocate(1, PageKind.KV)
    cache.offer(key, a[0])
    cache.offer(key, b[0])  # computed twice at once: the second copy is not cached
    cache.release(b)
    cache.release(a)
    assert cache.num_cached == cache.num_idle == 1 and pool.num_free == 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    base = make_random_llama(root / "base", layers=2)
    one = make_peft_adapter(base, root / "one", r=8, targets=["q_proj", "v_proj", "down_proj"], seed=3)
    two = make_peft_adapter(base, root / "two", r=4, targets=["k_proj", "o_proj"], seed=4)
    return base, one, two


def engine_for(base, **config) -> Engine:
    return Engine(EngineConfig(model=str(base), max_lora_rank=16, block_size=4, **config))


def conversation() -> list[list[int]]:
    """Turns of a chat: each resends the shared system prompt and the history before it."""
    rng = np.random.default_rng(0)
    turns, history = [], list(SYSTEM)
    for _ in range(3):
        history = history + rng.integers(3, 200, 9).tolist()
        turns.append(list(history))
    return turns


def test_cached_prefixes_give_the_uncached_answers_and_the_reference(checkpoint):
    base, one, _ = checkpoint
    answers = {}
    for caching in (False, True):
        engine = engine_for(base, enable_prefix_caching=caching)
        engine.add_adapter("one", one)
        outs = [engine.generate_batch([(turn, a)], GREEDY)[0] for turn in conversation() for a in ("one", None)]
        answers[caching] = outs
        stats = engine.stats()
        if caching:
            assert stats.prefix_cache_hit_rate > 0.5 and stats.pool_pages_cached > 0
            assert stats.pool_pages_kv == 0  # nothing held: the cached blocks are idle
        else:
            assert stats.prefix_cache_hit_rate == 0 and stats.pool_pages_cached == 0
        assert engine.debug.pool_free_pages() + stats.pool_pages_adapters == engine.debug.pool.capacity
    for off, on in zip(answers[False], answers[True]):
        assert off.token_ids == on.token_ids
        assert [x.logprob for x in on.logprobs] == pytest.approx([x.logprob for x in off.logprobs], abs=1e-5)
    for (turn, adapter), on in zip([(t, a) for t in conversation() for a in ("one", None)], answers[True]):
        tokens, lps = peft_greedy(base, one if adapter else None, turn, GREEDY.max_tokens)
        n = len(on.token_ids)
        assert on.token_ids == tokens[:n] and [x.logprob for x in on.logprobs] == pytest.approx(lps[:n], abs=1e-4)


async def test_no_block_is_shared_across_adapters_registrations_or_the_base(checkpoint):
    base, one, two = checkpoint
    engine = engine_for(base)
    engine.add_adapter("one", one)
    engine.add_adapter("two", two)
    prompt = SYSTEM + [7, 8, 9]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    await collect(engine, prompt, "one", params)
    hits = engine.debug.step_planner.prefix_hit_tokens

    async def hit_tokens(adapter) -> int:
        before = sum(hits.values())
        await collect(engine, prompt, adapter, params)
        return sum(hits.values()) - before

    assert await hit_tokens("one") == len(SYSTEM)  # its own blocks: a hit
    assert await hit_tokens("two") == 0  # same tokens, another adapter
    assert await hit_tokens(None) == 0  # the base
    assert await hit_tokens(None) == len(SYSTEM)
    engine.admin.catalog.remove("one")
    engine.add_adapter("one", two)  # the same name, other weights
    assert await hit_tokens("one") == 0
    await engine.close()


async def test_no_block_is_shared_across_tenants_outside_one_prefix_group(checkpoint):
    """A hit is a faster first token: were blocks shared, tenant a could tell that tenant b sent a
    prompt. Each tenant (no tenant: the default one) has its own blocks, on the base and on an
    adapter alike, unless the requests name one prefix group."""
    base, one, _ = checkpoint
    engine = engine_for(base)
    engine.add_adapter("one", one)
    prompt = SYSTEM + [7, 8, 9]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    hits = engine.debug.step_planner.prefix_hit_tokens

    async def hit_tokens(adapter, tenant=None, group=None) -> int:
        name = tenant or DEFAULT_TENANT
        before = hits.get(name, 0)
        await collect(engine, prompt, adapter, params, tenant=tenant, prefix_group=group)
        return hits[name] - before

    for adapter in (None, "one"):
        assert await hit_tokens(adapter, "b") == 0  # b's prompt is cached now
        assert await hit_tokens(adapter, "a") == 0  # the same tokens from a: no hit
        assert await hit_tokens(adapter, "a") == len(SYSTEM)  # its own blocks
        assert await hit_tokens(adapter, "b") == len(SYSTEM)
        assert await hit_tokens(adapter) == 0  # the embedded API's requests: the default tenant's
        assert await hit_tokens(adapter, DEFAULT_TENANT) == len(SYSTEM)
        assert await hit_tokens(adapter, "c", group="family") == 0
        assert await hit_tokens(adapter, "d", group="family") == len(SYSTEM)  # c's, shared in the group
        assert await hit_tokens(adapter, "family") == 0  # a tenant named like a group is not in it
        assert await hit_tokens(adapter, "c") == 0  # nor is c outside its group
    await engine.close()


async def test_cached_blocks_are_given_back_under_pressure_and_recomputed():
    """A pool that holds a few prompts' blocks: every new prompt evicts idle cached ones, and a
    prompt whose blocks were evicted is recomputed to the same answer."""
    # acme's 37 pages and 46 for KV (only acme: the larger demo adapters could never fit beside a sequence)
    cfg = EngineConfig(model=str(TINY_BASE_DIR), block_size=4, num_pages=1 + 37 + 46, max_num_seqs=2, max_model_len=184)
    engine = Engine(cfg)
    engine.add_adapter("acme", demo_adapter_dirs()["acme"])
    quiet = tiny_engine(enable_prefix_caching=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[(11 * k + j) % 200 + 3 for j in range(48)] for k in range(6)]
    expected = [(await collect(quiet, p, "acme", params))[0].token_ids for p in prompts]
    await quiet.close()
    for _ in range(2):
        got = [(await collect(engine, p, "acme", params))[0].token_ids for p in prompts]
        assert got == expected
    cache = engine.debug.prefix_cache
    room = engine.debug.pool.capacity - engine.stats().pool_pages_adapters
    assert room < 6 * 12  # the six prompts' 72 blocks cannot all stay cached: some were given back
    assert 0 < cache.num_cached <= room and cache.num_idle == cache.num_cached
    assert (
        engine.debug.pool.num_free + cache.num_idle + engine.stats().pool_pages_adapters == engine.debug.pool.capacity
    )
    await engine.close()


async def test_prefix_caching_can_be_turned_off():
    engine = tiny_engine(enable_prefix_caching=False)
    for _ in range(2):
        await collect(engine, SYSTEM + [9], "globex", GREEDY)
    assert engine.debug.prefix_cache.num_cached == 0 and engine.stats().prefix_cache_hit_rate == 0
    await engine.close()

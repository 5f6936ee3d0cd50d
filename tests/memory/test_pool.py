"""The unified pool: proportional adapter pages, KV capacity traded against adapters, eviction
rules, fragmentation, and exact accounting under random operations."""

from __future__ import annotations

import random

import pytest
import torch
from engine_util import tiny_engine
from hf_reference import make_peft_adapter

from lorapage import SamplingParams
from lorapage.memory.pages import PageKind
from lorapage.memory.pool import PagePool
from lorapage.tiny import TINY_BASE_DIR

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def pool_engine(**overrides):
    """The tiny engine taking rank-64 all-module adapters: outside the default shared envelope
    (tier dedicated, refused), but these tests are about pages, not about what an adapter costs."""
    return tiny_engine(shared_envelope="all:64", **overrides)


@pytest.fixture(scope="module")
def rank_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    return {r: make_peft_adapter(TINY_BASE_DIR, root / f"r{r}", r=r, targets=ALL, seed=r) for r in (8, 64)}


def test_pages_proportional_to_rank(rank_adapters):
    engine = pool_engine()
    p8 = engine.add_adapter("r8", rank_adapters[8]).num_pages
    p64 = engine.add_adapter("r64", rank_adapters[64]).num_pages
    assert p64 == pytest.approx(8 * p8, rel=0.15)  # ceil() rounding only


def test_adapter_pages_in_a_narrower_dtype_are_the_pools_own_memory():
    pool = PagePool(2, 10, 8, torch.float32, torch.device("cpu"), adapter_dtype=torch.bfloat16)
    assert pool.adapter_storage.shape == (2, 10, 16) and pool.adapter_page_size == 16
    assert pool.adapter_storage.data_ptr() == pool.storage.data_ptr()  # one pool, no second allocation
    pool.adapter_storage[1, 3] = 1.0  # written as adapter pages: page 3 of layer 1 and nothing else
    assert pool.storage[1, 3].abs().sum() > 0
    assert pool.storage[1, :3].abs().sum() == 0 and pool.storage[1, 4:].abs().sum() == 0
    assert pool.storage[0].abs().sum() == 0
    same = PagePool(1, 4, 8, torch.bfloat16, torch.device("cpu"))
    assert same.adapter_storage.data_ptr() == same.storage.data_ptr() and same.adapter_page_size == 8
    with pytest.raises(ValueError, match="must be no wider"):
        PagePool(1, 4, 8, torch.bfloat16, torch.device("cpu"), adapter_dtype=torch.float32)


@pytest.mark.parametrize("lora_dtype", ["bfloat16", "float16"])  # C kernels, and the PyTorch ops alone
def test_16_bit_adapters_take_half_the_pages_and_host_memory(rank_adapters, lora_dtype):
    wide, narrow = pool_engine(), pool_engine(lora_dtype=lora_dtype)
    # An auto-sized pool holds max_loras of the largest adapters beside the KV (no max_resident_loras): fewer pages now.
    assert narrow.debug.pool.num_pages < wide.debug.pool.num_pages
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    prompts = [[5, 9, 11, 40], [7, 3, 200, 17, 4, 90]]
    outs = []
    for engine in (wide, narrow):
        engine.add_adapter("r64", rank_adapters[64])
        outs.append(engine.generate_batch([(p, "r64") for p in prompts], params))  # loads it
    pages = [e.admin.info("r64").num_pages for e in (wide, narrow)]
    assert pages[1] in (pages[0] // 2, pages[0] // 2 + 1)  # half, rounded up
    assert [e.stats().pool_pages_adapters for e in (wide, narrow)] == pages
    host = [e.debug.adapters._host["r64@1"] for e in (wide, narrow)]
    assert host[1].dtype == getattr(torch, lora_dtype)
    assert host[1].nbytes * 2 == pytest.approx(host[0].nbytes, rel=0.05)
    for g, w in zip(outs[1], outs[0]):  # rounding each weight to 16 bits moves a logprob by far less than 0.05
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=0.05)


async def test_loading_shrinks_kv_capacity_and_evicting_restores_it(rank_adapters):
    engine = pool_engine()
    engine.add_adapter("r64", rank_adapters[64])
    free0 = engine.debug.pool_free_pages()
    await engine.admin.load("r64")
    pages = engine.admin.info("r64").num_pages
    assert engine.debug.pool_free_pages() == free0 - pages
    assert engine.stats().pool_pages_adapters == pages
    assert await engine.admin.unload("r64")
    assert engine.debug.pool_free_pages() == free0
    await engine.close()


async def test_in_use_adapter_is_never_evicted_and_idle_one_is(rank_adapters):
    # A pool just big enough for one rank-64 adapter plus a few KV blocks.
    probe = pool_engine()
    probe.add_adapter("r64", rank_adapters[64])
    need = probe.admin.info("r64").num_pages
    engine = pool_engine(num_pages=1 + need + 20, max_loras=2, max_resident_loras=2, max_model_len=80)
    engine.add_adapter("r64", rank_adapters[64])
    engine.add_adapter("r8", rank_adapters[8])
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    gen = engine.generate([5, 6, 7], "r64", params)
    first = await gen.__anext__()  # r64 is resident and running
    assert not first.finished
    # r8 cannot fit while r64 runs: the r64 request must keep going regardless.
    r8 = asyncio_task(engine, "r8")
    outs = [first]
    async for out in gen:
        outs.append(out)
        if not out.finished:  # once finished, r64 is idle and r8's waiting load may evict it
            assert engine.stats().resident_adapters == ("r64@1",)
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 30
    done = await r8  # once r64 is idle it may be evicted so r8 can load and run
    assert done.finished and len(done.token_ids) == 4
    assert engine.stats().resident_adapters == ("r8@1",)
    await engine.close()


def asyncio_task(engine, adapter):
    import asyncio

    async def run():
        last = None
        async for last in engine.generate([9, 10], adapter, SamplingParams(max_tokens=4, ignore_eos=True)):
            pass
        return last

    return asyncio.get_running_loop().create_task(run())


def test_fragmented_pool_gives_the_same_outputs(rank_adapters):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    clean = pool_engine()
    clean.add_adapter("r8", rank_adapters[8])
    want = clean.generate_batch([(p, a) for p, a in zip(prompts, ["r8", "acme", "initech"])], params)

    frag = pool_engine()
    frag.add_adapter("r8", rank_adapters[8])
    # Take every other page so adapters and KV blocks land on scattered pages.
    pool = frag.debug.pool
    taken = pool.allocate(pool.num_free, PageKind.KV)
    pool.free(taken[::2], PageKind.KV)
    got = frag.generate_batch([(p, a) for p, a in zip(prompts, ["r8", "acme", "initech"])], params)
    pages = frag.debug.residency.get("r8@1").page_ids
    assert pages[-1] - pages[0] != len(pages) - 1, "the adapter should be scattered"
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-5)


def test_random_operations_leave_free_count_where_it_started():
    rng = random.Random(0)
    pool = PagePool(num_layers=2, num_pages=200, page_size=8, dtype=torch.float32, device=torch.device("cpu"))
    start = pool.num_free
    held: list[tuple[list[int], PageKind]] = []
    for _ in range(1000):
        op = rng.random()
        if op < 0.55:
            kind = rng.choice(list(PageKind))
            pages = pool.allocate(rng.randrange(1, 12), kind)
            if pages is not None:
                assert len(set(pages)) == len(pages) and 0 not in pages
                held.append((pages, kind))
        elif held:
            pages, kind = held.pop(rng.randrange(len(held)))
            pool.free(pages, kind)
        in_use = sum(len(p) for p, _ in held)
        assert pool.num_free == start - in_use
        assert pool.used[PageKind.KV] + pool.used[PageKind.ADAPTER] == in_use
    for pages, kind in held:
        pool.free(pages, kind)
    assert pool.num_free == start
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([1], PageKind.KV)  # every page is free again: freeing one more is a bug


async def test_engine_random_submit_abort_evict_returns_every_page(rank_adapters):
    import asyncio

    rng = random.Random(1)
    engine = pool_engine(num_pages=400, max_loras=3, max_resident_loras=3, max_model_len=256)
    engine.add_adapter("r8", rank_adapters[8])
    engine.add_adapter("r64", rank_adapters[64])
    start = engine.debug.pool_free_pages()
    names = [None, "acme", "globex", "initech", "r8", "r64"]
    tasks, ids = [], []
    for i in range(120):
        rid = f"q{i}"
        params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=rng.choice([0.0, 0.8]), seed=i)
        tasks.append(
            asyncio.create_task(
                _drain(
                    engine, [rng.randrange(3, 200) for _ in range(rng.randrange(1, 30))], rng.choice(names), params, rid
                )
            )
        )
        ids.append(rid)
        if rng.random() < 0.3:
            await asyncio.sleep(0)
            engine.abort(rng.choice(ids))
        if rng.random() < 0.1:
            for n in engine.stats().resident_adapters:
                if engine.debug.residency.get(n).running == 0:
                    await engine.admin.unload(n)
    await asyncio.gather(*tasks)
    for n in list(engine.stats().resident_adapters):
        await engine.admin.unload(n)
    assert engine.debug.pool_free_pages() == start
    assert engine.stats().running == 0 and engine.stats().queue_depth == 0
    await engine.close()


async def _drain(engine, prompt, adapter, params, rid):
    async for _ in engine.generate(prompt, adapter, params, request_id=rid):
        pass


def test_fp16_kv_pages_hold_a_block_in_half_the_bytes():
    """kv_cache_dtype fp16 under a float32 model: a page is one block either way, in half the pool
    elements, so a pool budget holds twice the tokens; K/V see the pages in their own dtype."""
    from lorapage.memory.pool import kv_page_elements

    wide = kv_page_elements(16, 128, torch.float32, torch.float32)
    half = kv_page_elements(16, 128, torch.float32, torch.float16)
    assert wide == 2 * 16 * 128 and half * 2 == wide
    pool = PagePool(2, 8, half, torch.float32, torch.device("cpu"), kv_dtype=torch.float16)
    assert pool.kv_storage.dtype == torch.float16 and pool.kv_page_size == 2 * 16 * 128
    assert pool.kv_storage.data_ptr() == pool.storage.data_ptr()
    with pytest.raises(ValueError, match="no wider"):
        kv_page_elements(16, 128, torch.float16, torch.float32)


@pytest.mark.parametrize("lora_dtype, factor, num_pages", [("bfloat16", 2, 305), ("int8", 4, 321)])
async def test_narrow_pages_hold_more_adapters_in_the_same_bytes(rank_adapters, lora_dtype, factor, num_pages):
    """Issue 40, item 4: a pool of the same bytes (same pages of the same size) keeps twice as many
    resident bfloat16 adapters as float32 ones, and four times as many int8 ones (their per-row
    scales within the rounding; --lora-dtype int8), each loaded in turn until loads evict. A float32
    adapter here takes 37 pages, a bfloat16 one 19 and an int8 one 10 (half and a quarter, rounded
    up): the 304 and 320 pages past page 0 hold 8 and 16, and 8 and 32 (a pool whose size the
    rounding does not divide may hold one fewer)."""
    resident, pages = [], []
    for dtype in ("float32", lora_dtype):
        slots = dict(max_loras=64, max_resident_loras=64, max_cpu_loras=64)
        engine = pool_engine(lora_dtype=dtype, num_pages=num_pages, **slots)
        pool = engine.debug.pool
        assert pool.num_pages == num_pages
        assert pool.storage.nbytes == num_pages * pool.page_size * 4 * pool.storage.shape[0]
        names = [f"a{i}" for i in range(60)]
        for n in names:
            engine.add_adapter(n, rank_adapters[8])
            await engine.admin.load(n)
        resident.append(len(engine.stats().resident_adapters))
        pages.append(engine.admin.info(names[0]).num_pages)
        host = engine.debug.adapters._host[f"{names[-1]}@1"]
        assert host.dtype == getattr(torch, dtype)
        assert host.nbytes == pages[-1] * pool.page_size * 4 * pool.storage.shape[0]
        await engine.close()
    assert resident[0] < 60  # the float32 pool filled: loads evicted
    assert pages[1] == -(-pages[0] // factor)  # half or a quarter of the pages, rounded up
    usable = num_pages - 1
    assert resident == [usable // p for p in pages] and resident[1] == factor * resident[0], (resident, pages)

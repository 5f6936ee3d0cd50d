"""Prefix caching, preemption, a pin and a prefetch under tensor parallelism: one workload on a
TP=1 and a TP=2 (gloo) engine whose pool is too small for its requests. Requests share a long
prefix (cache hits), sequences take turns (preemptions), one adapter is pinned and stays resident
through the pressure, another is prefetched into host RAM before its request. Greedy tokens are
TP=1's and logprobs are within tests/parallel/test_tp.py's bound (any summation order)."""

from __future__ import annotations

import asyncio

import pytest
from engine_util import collect
from hf_reference import make_peft_adapter, make_random_llama
from test_tp import BOUND, INTERMEDIATE, LAYERS, MAX_RANK

from lorapage import Engine, EngineConfig, SamplingParams

PREFIX = [(7 * i + 3) % 250 + 4 for i in range(16)]  # four full blocks shared by every request
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
NUM_PAGES = 48  # the pinned adapter, one more (15 pages) and 32 blocks: sequences must take turns


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpfeat")
    base = make_random_llama(root / "base", layers=LAYERS, hidden=64, heads=4, kv_heads=2, intermediate=INTERMEDIATE)
    make_peft_adapter(base, root / "pinned", r=MAX_RANK, targets=["q_proj", "v_proj"], seed=1)
    make_peft_adapter(base, root / "busy", r=4, targets=["q_proj", "v_proj", "o_proj", "down_proj"], seed=2)
    make_peft_adapter(base, root / "ahead", r=MAX_RANK, targets=["k_proj", "o_proj"], seed=3)
    return root


async def wait_for(predicate, what: str) -> None:
    for _ in range(3000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def workload(root, tp: int):
    engine = Engine(
        EngineConfig(
            model=str(root / "base"),
            tensor_parallel_size=tp,
            max_lora_rank=MAX_RANK,
            block_size=4,
            num_pages=NUM_PAGES,
            max_model_len=32,
            enable_prefix_caching=True,
            max_loras=2,
            max_resident_loras=2,
        )
    )
    try:
        for name in ("pinned", "busy", "ahead"):
            engine.add_adapter(name, str(root / name))
        key = engine.admin.catalog.resolve_version("pinned")
        await engine.admin.catalog.set_pinned(key, True)
        await engine.admin.make_resident(key)
        # Tenant t used "ahead" lately (it is on disk): t's next request prefetches it into host RAM.
        engine.debug.residency.recent.use("t", "ahead@1", engine.debug.clock())
        first, _ = await collect(engine, PREFIX + [1], "busy", PARAMS, tenant="t")
        await wait_for(lambda: engine.debug.residency.prefetch.counts["done"] == 1, "the prefetch")
        assert engine.debug.residency.tier("ahead@1") == "ram"
        ahead, _ = await collect(engine, PREFIX + [2], "ahead", PARAMS, tenant="t")
        assert ahead.adapter_tier == "ram"
        # Eight sequences over the shared prefix at once: more than the pool's blocks hold.
        rows = [(PREFIX + [10 + i, 20 + i], ("busy", "pinned", None)[i % 3]) for i in range(8)]
        outs = await asyncio.gather(*(collect(engine, p, a, PARAMS, tenant="t") for p, a in rows))
        stats = engine.stats()
        return [first, ahead, *(o for o, _ in outs)], stats
    finally:
        await engine.close()


def test_prefix_cache_preemption_pin_and_prefetch_under_tp2_match_tp1(checkpoint):
    want, _ = asyncio.run(workload(checkpoint, 1))
    got, stats = asyncio.run(workload(checkpoint, 2))
    assert stats.preemptions > 0
    assert stats.prefix_cache_hit_rate > 0
    assert stats.adapter_prefetches_done == 1
    assert "pinned@1" in stats.resident_adapters and stats.adapters_pinned == 1
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=BOUND)

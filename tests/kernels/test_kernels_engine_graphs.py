"""CUDA-graph decode in the engine: one graph per batch bucket serves any mix of adapters, and
loading / evicting adapters between replays leaves the graphs valid (GPU only, except the bucket
arithmetic)."""

from __future__ import annotations

import pytest
from engine_util import tiny_engine

from lorapage import SamplingParams
from lorapage.model.cuda_graphs import batch_buckets

ROWS = [([5, 6, 7, 8], "acme"), ([9, 10, 11], "globex"), ([12, 13], None), ([14, 15, 16], "initech"), ([17], "acme")]


def test_buckets_cover_every_batch_size_largest_first():
    assert batch_buckets(64) == [64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1]
    assert batch_buckets(3) == [3, 2, 1]
    for n in (1, 5, 13, 64):
        assert all(any(b >= size for b in batch_buckets(n)) for size in range(1, n + 1))


def test_cpu_engine_captures_nothing():
    assert tiny_engine(device="cpu").debug.runner.graphs is None


@pytest.mark.gpu
def test_graph_replay_matches_eager_across_adapter_swaps():
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    graphs = tiny_engine(device="cuda", kernel_backend="triton", max_num_seqs=16)
    eager = tiny_engine(device="cuda", kernel_backend="triton", max_num_seqs=16, enforce_eager=True)
    assert graphs.debug.runner.graphs is not None and eager.debug.runner.graphs is None
    captured = set(graphs.debug.runner.graphs.graphs)
    assert captured == set(batch_buckets(16))  # one graph per bucket, whatever the adapters
    for engine in (graphs, eager):
        engine.generate_batch(ROWS, params)
    want = eager.generate_batch(ROWS, params)
    got = graphs.generate_batch(ROWS, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-3)
    # Evict everything, load in another order so adapters land in other slots / the same pages.
    import asyncio

    async def swap(engine):
        for name in ("acme", "globex", "initech"):
            await engine.admin.unload(name)
        for name in ("initech", "acme", "globex"):
            await engine.admin.load(name)

    for engine in (graphs, eager):
        asyncio.run(swap(engine))
    got = graphs.generate_batch(ROWS, params)
    want = eager.generate_batch(ROWS, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
    assert set(graphs.debug.runner.graphs.graphs) == captured

"""Tensor parallelism on this CPU: TP=2 over gloo against TP=1, one mixed batch of two PEFT adapters
and the base; the worker ranks' lifecycle (stopped on close, a killed rank fails requests, never hangs).

**The bound.** TP=1 and TP=2 run the same operations on the same values but for the order of their
sums: a row-parallel projection (o, down, and their LoRA shrinks) adds two half sums, and GEMMs of
other shapes may block their sums differently. However ``n`` terms are added, a float32 sum lies
within ``g(n) * sum |t_i|`` of the exact one (tests/numeric_bounds.py: ``n - 1`` roundings on any
term's path, one more for its product), so two orders differ by at most ``2 g(n)`` of the sum of
magnitudes, ``n <= N = intermediate + max rank`` here (the longest sum: down's plus its shrink).

To first order these relative perturbations pass through the network additively: each of the
``2 L`` residual blocks passes its input's perturbation on (the residual, gain 1) plus its own
branch's, whose gain from its input (RMSNorm rescales to unit RMS; a 64 x 96 matrix of std 0.08
has spectral norm about 0.08 (sqrt 64 + sqrt 96) = 1.4, and a branch chains two or three) we
budget at ``GAIN`` = 4 per block, giving ``(1 + GAIN) ** (2 L)`` over the stack. The final norm and
``lm_head`` put the relative perturbation on the logits scaled by ``max |z|`` (< 4 here: unit-RMS
hidden states times rows of std 0.08 over 64 inputs give logits of std 0.64, and 4 is six of those),
and ``log_softmax`` moves by at most twice the largest logit change. So

    |lp_tp1 - lp_tp2| <= 2 * 2 g(N) * (1 + GAIN) ** (2 L) * max |z|

which for N = 104, L = 2 is 2 * 1.24e-5 * 625 * 4 = 6.2e-2 (Qwen3's q of 4 x 32 makes N = 136).
Loose (a first-order worst case with a gain budget, not a proof through every nonlinearity, and
not the last bits this CPU gave: the runs here differ by ~1e-6), yet a shard mis-sliced by one head
or one column moves logprobs by far more: the test also checks that the adapters' own effect,
which such a slip corrupts, is larger than the bound.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

import pytest
from hf_reference import make_peft_adapter, make_random_llama, make_random_model
from numeric_bounds import U32, gamma

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import EngineStepError

LAYERS, INTERMEDIATE, MAX_RANK = 2, 96, 8
GAIN = 4.0
MAX_LOGIT = 4.0


def bound(longest_sum: int) -> float:
    """The docstring's bound, for a model whose longest sum (with its LoRA shrink) has ``longest_sum`` terms."""
    return 2 * 2 * gamma(longest_sum, U32) * (1 + GAIN) ** (2 * LAYERS) * MAX_LOGIT


BOUND = bound(INTERMEDIATE + MAX_RANK)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [([1, 2, 3, 4, 5], None), ([7, 8, 9], "a1"), ([10, 11, 12, 13], "a2"), ([5, 6], "a1"), ([3, 9, 27], "a2")]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    base = make_random_llama(root / "base", layers=LAYERS, hidden=64, heads=4, kv_heads=2, intermediate=INTERMEDIATE)
    make_peft_adapter(base, root / "a1", r=MAX_RANK, targets=ALL, seed=1)
    make_peft_adapter(base, root / "a2", r=4, targets=["q_proj", "v_proj", "o_proj", "down_proj"], seed=2)
    return root


def _engine(root, tp: int, **config) -> Engine:
    engine = Engine(EngineConfig(model=str(root / "base"), tensor_parallel_size=tp, max_lora_rank=MAX_RANK, **config))
    for name in ("a1", "a2"):
        engine.add_adapter(name, str(root / name))
    return engine


def _workers() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("lorapage-tp-")]


@pytest.fixture(scope="module")
def tp2(checkpoint):
    engine = _engine(checkpoint, 2)
    yield engine
    asyncio.run(engine.close())


def test_tp2_matches_tp1_in_one_mixed_batch(checkpoint, tp2):
    one = _engine(checkpoint, 1)
    want = one.generate_batch(PROMPTS, GREEDY)
    got = tp2.generate_batch(PROMPTS, GREEDY)
    asyncio.run(one.close())
    assert BOUND < 0.1
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=BOUND)
    # The bound is tighter than what the adapters do (what a mis-sliced shard would corrupt).
    base, adapted = want[0], tp2.generate_batch([(PROMPTS[0][0], "a1")], GREEDY)[0]
    moved = abs(adapted.logprobs[0].logprob - base.logprobs[0].logprob)
    assert adapted.token_ids != base.token_ids or moved > BOUND


def test_adapter_bytes_per_rank_are_a_shard(tp2, checkpoint):
    """A rank's pages are half as wide (its KV heads) and hold its shard, half of every matrix
    (fully sharded): an adapter's bytes per rank are half of TP=1's, but for rounding to pages."""
    one = _engine(checkpoint, 1)
    for name in ("a1", "a2"):
        per_rank = tp2.admin.info(name).num_pages * tp2._sizing.page_size
        whole = one.admin.info(name).num_pages * one._sizing.page_size
        assert per_rank <= whole / 2 + tp2._sizing.page_size
    assert tp2._sizing.page_size * 2 == one._sizing.page_size
    asyncio.run(one.close())


def test_refusals(checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the base's num_attention_heads"):
        Engine(EngineConfig(model=str(checkpoint / "base"), tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model=str(checkpoint / "base"), tensor_parallel_size=0)


def test_dora_lora_bias_and_embedding_lora_match_tp1(checkpoint, tp2, tmp_path):
    """DoRA's column factors (norms over the whole weight, read from the checkpoint; o and down's
    whole on every rank, scaling their partial sums), lora_bias (o and down's on rank 0 alone) and
    an embedding LoRA (its data on every rank, added to the all-reduced embeddings) at TP=2 give
    TP=1's tokens, in one batch."""
    base = checkpoint / "base"
    make_peft_adapter(base, tmp_path / "dora", r=4, targets=["q_proj", "o_proj", "down_proj"], seed=3, use_dora=True)
    make_peft_adapter(base, tmp_path / "bias", r=4, targets=["v_proj", "down_proj"], seed=5, lora_bias=True)
    make_peft_adapter(base, tmp_path / "emb", r=4, targets=["embed_tokens", "q_proj"], seed=4)
    one = Engine(EngineConfig(model=str(base), max_lora_rank=MAX_RANK))
    rows = [([7, 8, 9], "dora"), ([10, 11, 12, 13], "bias"), ([200, 3, 140], "emb"), ([1, 2, 3], None)]
    for engine in (one, tp2):
        for name in ("dora", "bias", "emb"):
            engine.add_adapter(name, str(tmp_path / name))
    want, got = one.generate_batch(rows, GREEDY), tp2.generate_batch(rows, GREEDY)
    asyncio.run(one.close())
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=BOUND)


def test_close_stops_the_workers(tp2):
    """Last of the tests on the module's engine: closing it stops its worker."""
    workers = _workers()
    assert len(workers) == 1 and workers[0].is_alive()
    asyncio.run(tp2.close())
    workers[0].join(15)
    assert not workers[0].is_alive() and _workers() == []


def test_qwen3_matches_and_a_killed_rank_fails_requests_never_hangs(checkpoint, tmp_path):
    """Qwen3 (per-head q/k norms whole on each rank, head_dim 32 of its own, tied embeddings) at
    TP=2 against TP=1; then its worker is killed: requests fail at once, with the reason, and so do
    later ones (the engine is stopped), within a bounded wait."""
    from transformers import Qwen3Config

    base = make_random_model(
        tmp_path / "qwen3",
        Qwen3Config,
        vocab_size=261,
        hidden_size=64,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=260,
        bos_token_id=None,
    )
    make_peft_adapter(base, tmp_path / "q1", r=MAX_RANK, targets=ALL, seed=4)
    rows = [([1, 2, 3, 4], None), ([7, 8, 9], "q1"), ([5, 6], "q1")]
    engines = {}
    for tp in (1, 2):
        others = {p.pid for p in _workers()}
        engines[tp] = Engine(EngineConfig(model=str(base), tensor_parallel_size=tp, max_lora_rank=MAX_RANK))
        engines[tp].add_adapter("q1", str(tmp_path / "q1"))
    want, got = (engines[tp].generate_batch(rows, GREEDY) for tp in (1, 2))
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        lps = [x.logprob for x in w.logprobs]
        assert [x.logprob for x in g.logprobs] == pytest.approx(lps, abs=bound(4 * 32 + MAX_RANK))
    asyncio.run(engines[1].close())

    engine = engines[2]
    (worker,) = [p for p in _workers() if p.pid not in others]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)

    async def run(adapter):
        return await asyncio.wait_for(engine.run_to_end([1, 2, 3], adapter, GREEDY), 30)

    for adapter in ("q1", None):  # the engine stays stopped: the next request fails too, at once
        with pytest.raises(EngineStepError, match="tensor-parallel rank 1 died") as failed:
            asyncio.run(run(adapter))
        assert failed.value.status == 503  # the service is gone, not the request: a supervisor restarts it
    asyncio.run(engine.close())


def test_a_rank_that_fails_to_start_fails_the_start_and_leaves_nothing(tmp_path):
    """A worker that cannot build its shard says why; the group is not made and no process is left."""
    import torch

    from lorapage.parallel.group import TensorParallelError, TensorParallelGroup
    from lorapage.parallel.wire import WorkerSpec

    numbers = dict.fromkeys(("max_model_len", "block_size", "page_size", "num_pages", "lora_slots"), 8)
    numbers |= dict.fromkeys(("page_list_width", "max_num_seqs", "max_num_batched_tokens", "max_blocks"), 8)
    spec = WorkerSpec(
        model_dir=str(tmp_path / "missing"),
        world_size=2,
        timeout_s=30,
        device="cpu",
        dtype=torch.float32,
        lora_dtype=torch.float32,
        kernel_backend="torch",
        threads=1,
        lora_h_width=8,
        **numbers,
    )
    others = {p.pid for p in _workers()}
    with pytest.raises(TensorParallelError, match="rank 1 failed to start"):
        TensorParallelGroup(spec)
    assert [p for p in _workers() if p.pid not in others] == []

"""Chunked prefill: prompts longer than the step's token budget are computed over several steps,
mixed with decodes, and give exactly what unchunked prefill gives (checked against transformers +
peft), with the books balanced afterwards."""

from __future__ import annotations

import asyncio

import pytest
from engine_util import collect, tiny_engine
from hf_reference import make_peft_adapter, make_random_llama, peft_greedy

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.kernels.triton_import import triton_available
from lorapage.tiny import DEMO_MARKERS

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(50, 71)), [100, 3, 41, 5]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    base = make_random_llama(root / "base", layers=2)
    adapter = make_peft_adapter(base, root / "lora", r=8, targets=["q_proj", "v_proj", "down_proj"], seed=3)
    return base, adapter


def run(base, adapter, **config) -> list:
    engine = Engine(EngineConfig(model=str(base), max_lora_rank=16, block_size=4, **config))
    engine.add_adapter("a", adapter)
    items = [(p, "a" if i % 2 == 0 else None) for i, p in enumerate(PROMPTS)]
    outs = engine.generate_batch(items, GREEDY)
    assert engine.debug.pool_free_pages() + engine.stats().pool_pages_adapters == engine.debug.pool.capacity
    return outs


def test_chunked_outputs_equal_unchunked_and_the_reference(checkpoint):
    base, adapter = checkpoint
    whole = run(base, adapter)
    chunked = run(base, adapter, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=128)
    for i, (prompt, a, b) in enumerate(zip(PROMPTS, whole, chunked)):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-5)
        tokens, lps = peft_greedy(base, adapter if i % 2 == 0 else None, prompt, GREEDY.max_tokens)
        n = len(b.token_ids)  # the reference does not stop at EOS; the engine does
        assert b.token_ids == tokens[:n] and (n == len(tokens) or b.finish_reason == "stop")
        assert [x.logprob for x in b.logprobs] == pytest.approx(lps[:n], abs=1e-4)


async def test_a_long_prompt_is_chunked_while_other_streams_decode():
    """With a budget of 8 tokens, a 60-token prompt takes several steps; the running streams
    keep getting a token every step meanwhile, and everyone's answer is the unchunked one."""
    engine = tiny_engine(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=256)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = tiny_engine()
    long_prompt = list(range(5, 65))
    expected_long, _ = await collect(reference, long_prompt, "globex", params)
    expected_short, _ = await collect(reference, [5, 6, 7], "acme", params)
    await reference.close()

    steps_per_token: list[int] = []
    short = asyncio.ensure_future(collect(engine, [5, 6, 7], "acme", params))
    while not engine.debug.step_planner.running or engine.debug.step_planner.running[0].output_ids == []:
        await asyncio.sleep(0.005)
    long = asyncio.ensure_future(collect(engine, long_prompt, "globex", params))
    while not long.done():
        running = {r.adapter.partition("@")[0]: r for r in engine.debug.step_planner.running if r.adapter}
        if "globex" in running and running["globex"].num_computed < len(long_prompt):
            steps_per_token.append(len(running["acme"].output_ids) if "acme" in running else -1)
        await asyncio.sleep(0)
    (short_out, _), (long_out, _) = await short, await long
    assert long_out.token_ids == expected_long.token_ids
    assert short_out.token_ids == expected_short.token_ids
    assert len(set(steps_per_token)) > 1, "the short stream made no progress while the long prompt was prefilled"
    assert engine.debug.pool_free_pages() + engine.stats().pool_pages_adapters == engine.debug.pool.capacity
    await engine.close()


async def test_chunked_prefill_survives_preemption_and_aborts():
    """A pool too small for everyone: chunked prompts are preempted and recomputed, some streams
    are broken off, and every finished answer is still the quiet engine's."""
    # initech alone takes 73 pages of 4-token blocks: with every adapter resident, KV gets ~23.
    engine = tiny_engine(max_num_batched_tokens=8, max_num_seqs=4, num_pages=140, max_model_len=96)
    quiet = tiny_engine()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [(list(range(5, 5 + n)), a) for n, a in [(30, "acme"), (25, None), (40, "initech"), (12, "globex")]]
    expected = [(await collect(quiet, p, a, params))[0].token_ids for p, a in prompts]
    await quiet.close()

    async def broken(p, a):
        async for out in engine.generate(p, a, params):
            if len(out.token_ids) >= 2:
                break

    results = await asyncio.gather(*(collect(engine, p, a, params) for p, a in prompts), broken(*prompts[0]))
    assert [out.token_ids for out, _ in results[:4]] == expected
    for _ in range(100):
        if not engine.debug.step_planner.requests:
            break
        await asyncio.sleep(0.01)
    assert not engine.debug.step_planner.requests and not engine.debug.step_planner.running
    assert engine.debug.pool_free_pages() + engine.stats().pool_pages_adapters == engine.debug.pool.capacity
    assert all(e.running == 0 and e.waiting == 0 for e in engine.debug.residency.adapters.values())
    assert engine.stats().preemptions > 0  # the pool is sized so that it must preempt
    await engine.close()


def test_without_chunking_the_budget_must_hold_the_context():
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        tiny_engine(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=False)


def test_demo_markers_survive_a_small_budget():
    engine = tiny_engine(max_num_batched_tokens=16, max_num_seqs=4)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}])
    outs = engine.generate_batch([(prompt, a) for a in DEMO_MARKERS], SamplingParams(max_tokens=40, temperature=0.0))
    assert [o.text for o in outs] == list(DEMO_MARKERS.values())


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
async def test_chunks_through_the_triton_prefill_kernel_match_the_torch_backend():
    """The Triton backend (interpreted here) prefills chunks after a computed prefix with its
    paged prefill kernel: the same tokens as the PyTorch backend unchunked."""
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
    prompt = list(range(5, 27))
    torch_engine = tiny_engine()
    expected, _ = await collect(torch_engine, prompt, "globex", params)
    await torch_engine.close()
    engine = tiny_engine(kernel_backend="triton", max_num_batched_tokens=8, max_num_seqs=2, max_model_len=64)
    out, _ = await collect(engine, prompt, "globex", params)
    assert out.token_ids == expected.token_ids
    assert [x.logprob for x in out.logprobs] == pytest.approx([x.logprob for x in expected.logprobs], abs=1e-4)
    await engine.close()

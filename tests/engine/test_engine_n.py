"""``n`` sequences from one prompt: one prefill, then branches that take the prompt's KV blocks
from the prefix cache (computing only what its last, partial block holds)."""

from __future__ import annotations

import asyncio

import pytest
from engine_util import tiny_engine

from lorapage import SamplingParams


async def run(engine, prompt, adapter, sampling):
    finals = {}
    async for out in engine.generate(prompt, adapter, sampling):
        if out.finished:
            finals[out.index] = out
    return [finals[k] for k in sorted(finals)]


@pytest.mark.parametrize("prompt_len", [37, 40])  # a partial last block, and none
async def test_n_branches_cost_one_prefill(prompt_len):
    engine = tiny_engine(block_size=4)
    try:
        prompt = [(11 * i) % 200 + 3 for i in range(prompt_len)]
        before = engine.debug.step_planner.prompt_tokens_computed
        outs = await run(engine, prompt, "acme", SamplingParams(n=4, max_tokens=6, temperature=2.0, seed=3))
        computed = engine.debug.step_planner.prompt_tokens_computed - before
        assert [o.index for o in outs] == [0, 1, 2, 3] and all(len(o.token_ids) == 6 for o in outs)
        # The first branch computes the prompt; each other one only the tokens after its last full
        # block (at least one token, for its own logits).
        assert computed <= prompt_len + 3 * 4, computed
        assert len({tuple(o.token_ids) for o in outs}) > 1  # seeds 3, 4, 5, 6: different draws
        again = await run(engine, prompt, "acme", SamplingParams(n=4, max_tokens=6, temperature=2.0, seed=3))
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # reproducible per branch
        greedy = await run(engine, prompt, "globex", SamplingParams(n=3, max_tokens=6, temperature=0))
        assert len({tuple(o.token_ids) for o in greedy}) == 1
        assert not engine.debug.step_planner.requests  # every branch finished and left
    finally:
        await engine.close()


async def test_stopping_early_aborts_every_branch():
    engine = tiny_engine()
    try:
        gen = engine.generate("Hello", "acme", SamplingParams(n=3, max_tokens=40, temperature=1.0, ignore_eos=True))
        seen = set()
        async for out in gen:
            seen.add(out.index)
            if len(seen) == 3:
                break
        await gen.aclose()
        for _ in range(100):  # aborted branches leave within a step or two
            if not engine.debug.step_planner.requests:
                break
            await asyncio.sleep(0.02)
        assert not engine.debug.step_planner.requests
    finally:
        await engine.close()


async def test_prompt_logprobs_are_computed_once_for_every_branch():
    """``n`` branches that ask for prompt logprobs: the first computes the prompt (and its
    logprobs), the others take its blocks, and every branch reports that one list."""
    engine = tiny_engine(block_size=4)
    try:
        prompt = [(7 * i) % 200 + 3 for i in range(40)]
        sampling = SamplingParams(n=6, max_tokens=3, temperature=1.0, seed=1, prompt_logprobs=2)
        before = engine.debug.step_planner.prompt_tokens_computed
        outs = await run(engine, prompt, None, sampling)
        computed = engine.debug.step_planner.prompt_tokens_computed - before
        assert computed <= 40 + 5 * 4, computed  # once, not six times
        first = outs[0].prompt_logprobs
        assert first is not None and len(first) == 40 and first[0] is None
        assert all(o.prompt_logprobs is first for o in outs)  # one list, not six copies
        alone = await run(engine, prompt, None, SamplingParams(max_tokens=1, prompt_logprobs=2))
        assert [lp and (lp.token_id, lp.logprob) for lp in alone[0].prompt_logprobs] == [
            lp and (lp.token_id, lp.logprob) for lp in first
        ]
    finally:
        await engine.close()


async def test_branches_are_built_from_the_first_without_the_prompts_work(monkeypatch):
    """Finding 2 of issue 38: a branch takes its prompt's checked ids and block keys from the
    first sequence; the prompt is checked and hashed once, whatever ``n``."""
    from lorapage.engine import intake as intake_module

    engine = tiny_engine(block_size=4)
    hashed: list[int] = []
    real = intake_module.block_keys

    def counted(namespace, ids, block_size, **kw):
        hashed.append(len(ids))
        return real(namespace, ids, block_size, **kw)

    monkeypatch.setattr(intake_module, "block_keys", counted)
    try:
        prompt = [(5 * i) % 200 + 3 for i in range(64)]
        outs = await run(engine, prompt, None, SamplingParams(n=16, max_tokens=2, temperature=1.0, seed=2))
        assert [o.index for o in outs] == list(range(16))
        assert hashed == [64]  # once for the prompt, not 16 times
    finally:
        await engine.close()

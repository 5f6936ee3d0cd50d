"""The lent tail lane's bound end to end on the tiny model: two adapters hold both lanes (one of
them the lent tail lane) with generations of 400 tokens, and a single-request adapter arrives
mid-way. Its first token comes within ``lane_lend_max_tokens`` steps (16 by default): the recalled
holder's rows are preempted and finish later, in full. Without the bound it waits for a whole
holder's generation. Steps are counted as the engine applies them, never by wall time."""

from __future__ import annotations

import asyncio

import pytest
from engine_util import collect, tiny_engine

from lorapage import SamplingParams

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


async def _tail_wait(bound: int) -> tuple[int, list[int], int]:
    """Steps the single waited for its first token, the holders' output lengths, preemptions."""
    engine = tiny_engine(max_loras=2, reserved_tail_lanes=1, max_resident_loras=3, lane_lend_max_tokens=bound)
    try:
        for name in ("acme", "globex", "initech"):  # resident: the wait is the lane's, not a load's
            await collect(engine, "Hello", name, SamplingParams(max_tokens=1, temperature=0))
        planner = engine.debug.step_planner
        steps, apply = [0], planner.apply
        sampled_at: dict[str, int] = {}  # request id -> the step that sampled its first token
        submitted_at: dict[str, int] = {}  # request id -> steps applied when it reached the planner
        submit = planner.submit

        def noted(req) -> None:  # type: ignore[no-untyped-def]
            submitted_at[req.request_id] = steps[0]
            submit(req)

        def counted(plan, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            steps[0] += 1
            apply(plan, *args, **kwargs)
            for req, done in zip(plan.sequences, plan.completes):
                if done:
                    sampled_at.setdefault(req.request_id, steps[0])

        planner.apply = counted  # type: ignore[method-assign]
        planner.submit = noted  # type: ignore[method-assign]

        async def holder(adapter: str) -> int:
            last, _ = await collect(engine, "Hello there", adapter, LONG)
            return len(last.token_ids)

        holders = [asyncio.create_task(holder(a)) for a in ("acme", "acme", "globex", "globex")]
        while steps[0] < 60:  # mid-way through the holders' generations
            await asyncio.sleep(0.005)
        assert engine.stats().preemptions == 0
        outputs = [out async for out in engine.generate("Hi", "initech", SamplingParams(max_tokens=2, temperature=0))]
        # Counted from when it reached the planner (tokenizing runs off the loop while steps go on)
        # to the step that sampled it (its delivery may lag a step under load).
        rid = outputs[0].request_id
        arrived, first = submitted_at[rid], sampled_at[rid]
        lengths = list(await asyncio.gather(*holders))
        return first - arrived, lengths, engine.stats().preemptions
    finally:
        await engine.close()


@pytest.mark.parametrize("bound", [0, 16])
async def test_a_tail_adapter_gets_its_first_token_within_the_bound_behind_long_generations(bound):
    waited, lengths, preemptions = await _tail_wait(bound)
    assert lengths == [400] * 4  # the preempted rows were readmitted and finished in full
    if bound:
        # The step it was refused in, the bound's steps, the step that prefills it: at most 2 more.
        assert waited <= bound + 2
        assert preemptions == 2  # one holder's two rows
    else:
        assert waited >= 200 and preemptions == 0  # the recalled holder's whole generation

"""The step planner's admissions: refused when they can never fit, undone cleanly when the policy or
the adapter cache fails mid-step, and as many distinct adapters as lanes admitted in one step."""

from __future__ import annotations

import asyncio
import threading

import pytest
from engine_util import collect, tiny_engine

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import AdapterFormatError, EngineStepError
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs


async def test_adapter_that_cannot_fit_beside_one_full_sequence_is_refused_at_registration():
    """Pool fit: an adapter whose pages and one full-length sequence's KV blocks do
    not fit the pool could never serve a request, so registration refuses it with the arithmetic;
    a shorter max_model_len that fits takes it and serves."""
    probe = tiny_engine()
    pages = probe.admin.info("initech").num_pages
    await probe.close()
    base = dict(model=str(TINY_BASE_DIR), block_size=4, num_pages=1 + pages + 3, max_lora_rank=64)
    engine = Engine(EngineConfig(**base))
    with pytest.raises(AdapterFormatError) as exc:
        engine.add_adapter("initech", demo_adapter_dirs()["initech"])
    msg = str(exc.value)
    blocks = -(-engine.max_model_len // 4)
    for part in (f"needs {pages} pages", f"{blocks} pages for one full-length sequence", "max_lora_rank 64"):
        assert part in msg, msg
    assert f"the pool has {engine.debug.pool.capacity} pages" in msg
    assert engine.admin.served() == []  # nothing half-registered
    await engine.close()
    fits = Engine(EngineConfig(**base, max_model_len=12))  # 3 blocks of 4 beside the adapter
    fits.add_adapter("initech", demo_adapter_dirs()["initech"])
    out, _ = await asyncio.wait_for(collect(fits, [5, 9, 12, 30], "initech", SamplingParams(max_tokens=8)), 10)
    assert len(out.token_ids) == 8
    await fits.close()


async def test_policy_failing_mid_schedule_leaks_nothing():
    """A scheduling policy that raises after admitting requests: those requests get the error,
    and their pages and adapter pins come back, so the engine serves the next request normally."""
    engine = tiny_engine()
    await engine.admin.load("acme")
    free = engine.debug.pool_free_pages()
    schedule = engine.debug.policy.schedule

    def failing_schedule(now, ctx):
        if schedule(now, ctx):
            engine.debug.policy.schedule = schedule
            raise RuntimeError("policy bug")
        return []

    engine.debug.policy.schedule = failing_schedule
    with pytest.raises(EngineStepError, match="policy bug"):
        await collect(engine, [5, 9, 12, 30], "acme", SamplingParams(max_tokens=4))
    entry = engine.debug.residency.get("acme@1")
    assert (entry.running, entry.waiting) == (0, 0)
    assert engine.debug.pool_free_pages() == free
    out, _ = await collect(engine, [5, 9, 12, 30], "acme", SamplingParams(max_tokens=4))
    assert out.finish_reason == "length"
    await engine.close()


async def test_admission_of_a_non_resident_adapter_undoes_cleanly():
    """A policy bug admits a request whose adapter is still loading: acquire() refuses before
    pinning anything, and the undo must not release a pin that was never taken."""
    engine = tiny_engine(scheduler="fcfs")
    gate = threading.Event()
    engine.debug.threads.forward.submit(gate.wait, 10)  # globex's copy queues behind this: not resident yet
    inner = engine.debug.policy.policy
    schedule = engine.debug.policy.schedule

    def forgets_adapter_ready(now, ctx):
        for req in list(inner._waiting):
            ctx.try_admit(req)
        return []

    engine.debug.policy.schedule = forgets_adapter_ready
    with pytest.raises(EngineStepError, match="admitted while not resident"):
        await collect(engine, [5, 9, 12, 30], "globex", SamplingParams(max_tokens=4))
    engine.debug.policy.schedule = schedule
    gate.set()
    await asyncio.sleep(0.1)
    entry = engine.debug.residency.get("globex@1")
    assert (entry.running, entry.waiting) == (0, 0)
    engine.admin.catalog.remove("globex")  # refused if a pin had gone negative
    await engine.close()


@pytest.mark.parametrize("scheduler", ["vtc", "fcfs"])
async def test_as_many_adapters_as_lanes_run_as_one_batch(scheduler):
    """Issue 27's mix through the engine: 8 adapters at max_loras=8, request i on adapter i mod 8.
    VTC lends its reserved tail lane to the eighth adapter, so both policies admit all 32 in the
    first step and finish in one generation of steps (VTC took twice as many, with half the rows,
    while the tail lane stayed reserved)."""
    engine = Engine(
        EngineConfig(model=str(TINY_BASE_DIR), max_loras=8, max_lora_rank=64, block_size=4, scheduler=scheduler)
    )
    dirs = list(demo_adapter_dirs().values())
    for k in range(8):
        engine.add_adapter(f"a{k}", dirs[k % len(dirs)])
        await engine.admin.load(f"a{k}")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = await asyncio.gather(*(collect(engine, [5 + i, 9, 12], f"a{i % 8}", params) for i in range(32)))
    assert all(len(out.token_ids) == 12 for out, _ in outs)
    steps = engine.debug.scheduler_metrics.batch_size
    assert (steps.count, steps.sum) == (12, 32 * 12)
    await engine.close()


class _NoAdapters:
    """The adapter cache's side of the step planner, for requests that use no adapter: no
    load waits for pages and nothing idle can be given back."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def room_for_kv(self, pages_needed: int, *, reserve: bool = True) -> bool:
        return self.pool.num_free >= pages_needed

    def finish(self, name: str | None) -> None:
        pass

    def memory_freed(self) -> None:
        pass

    def take_failed(self) -> dict:
        return {}


class _Letters:
    def push(self, token_id: int) -> str:
        return "x"

    def flush(self) -> str:
        return ""


async def test_an_abort_of_a_prompt_left_out_of_the_running_step_ends_it_with_that_step():
    """A prompt being prefilled in chunks gets no chunk this step (its pages are short); the
    client goes away while the step runs. The request must end when the step is applied, not
    hold its pages until it next runs."""
    import torch

    from lorapage.engine.step_planner import StepLimits, StepPlanner
    from lorapage.memory.pages import PageKind
    from lorapage.memory.pool import PagePool
    from lorapage.model.sampler import SampleOutput
    from lorapage.request import Request, RequestStatus
    from lorapage.scheduler.fcfs import FcfsScheduler

    pool = PagePool(1, 200, 8, torch.float32, torch.device("cpu"))
    steps = StepPlanner(FcfsScheduler(), _NoAdapters(pool), pool, StepLimits(4, 8, 8, 200, frozenset()), lambda: 0.0)

    def request(rid: str, n: int, t: float) -> Request:
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        return Request(rid, "t", None, list(range(1, n + 1)), params, t, "none", _Letters(), None)

    def run(plan) -> SampleOutput:
        n = sum(plan.completes)
        return SampleOutput([7] * n, [None] * n, [None] * n)

    short, long = request("short", 3, 0.0), request("long", 30, 1.0)
    for r in (short, long):
        steps.submit(r)
    for _ in range(2):
        plan = steps.plan_step()
        steps.apply(plan, run(plan))
    pool.allocate(pool.num_free - 1, PageKind.ADAPTER)  # an adapter load took all but one free page
    plan = steps.plan_step()
    assert long not in plan.sequences and long.status is RequestStatus.RUNNING
    steps.abort("long")
    steps.apply(plan, run(plan))
    assert long.status is RequestStatus.FINISHED and long.block_table == [] and "long" not in steps.requests
    assert (await long.outputs.get()).finish_reason == "abort"

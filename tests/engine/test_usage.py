"""Cost attribution: a replayed trace of several tenants on the base and on adapters that load,
evict and reload; what is charged per (hour, tenant, adapter) adds up to the engine's own
totals, counted apart (step time, prompt tokens, generated tokens, loads)."""

from __future__ import annotations

import math

from server_harness import make_engine

from lorapage.replay.driver import RunOptions, replay
from lorapage.replay.embedded import EmbeddedTarget
from lorapage.traces.records import OK
from lorapage.traces.trace import TraceRequest
from lorapage.usage import USAGE_FIELDS, Usage

MODELS = ["base", "base:acme", "base:globex", "base:initech"]


async def test_the_parts_add_up_to_the_engine_totals():
    engine = make_engine(
        max_loras=2, max_resident_loras=2, block_size=4
    )  # three adapters, two slots: loads and evictions
    trace = [
        TraceRequest(arrival_s=0.02 * i, tenant=f"t{i % 3}", model=MODELS[i % 4], prompt="Hello " * (1 + i % 5),
                     max_tokens=4 + i % 7)
        for i in range(40)
    ]  # fmt: skip
    try:
        result = await replay(trace, EmbeddedTarget(engine), RunOptions(speed=1.0))
        assert all(r.outcome == OK for r in result.records), [r.error for r in result.records if r.outcome != OK]
        rows = engine.usage_rows()
    finally:
        await engine.close()
    parts = Usage()
    for _, usage in rows:
        parts.add(usage)
    totals = engine.debug.usage.totals
    for name in USAGE_FIELDS:
        assert math.isclose(getattr(parts, name), getattr(totals, name), rel_tol=0.01), name
    # The totals, counted apart by the engine.
    assert parts.requests == len(trace)
    assert math.isclose(parts.device_s, engine.debug.step_loop.busy_s, rel_tol=0.01)
    assert parts.prompt_tokens == engine.debug.step_planner.prompt_tokens_computed
    assert parts.output_tokens == sum(r.output_tokens for r in result.records)
    loads = engine.debug.adapter_metrics.loads
    assert sum(loads.values()) >= 3 and parts.load_bytes > 0 and parts.adapter_page_s > 0
    by_tenant = {key[1] for key, _ in rows}
    assert {"t0", "t1", "t2"} <= by_tenant and "" in by_tenant  # adapter costs under no tenant
    adapter_rows = {key[2] for key, u in rows if key[1] == "" and u.load_bytes}
    assert adapter_rows <= {engine.admin.catalog.resolve_version(a) for a in ("acme", "globex", "initech")}


def test_a_step_is_shared_by_tokens_and_residency_by_wall_time():
    from lorapage.usage import StepRow, UsageLedger

    ledger = UsageLedger(retention_hours=2)
    ledger.record_step(
        10.0, 0.3, [StepRow("a", "", 20, 1, 5), StepRow("b", "x@1", 0, 1, 2), StepRow("a", "x@1", 8, 0, 3)]
    )
    rows = dict(ledger.query())
    assert rows[(0, "a", "")].device_s == 0.3 * 21 / 30 and rows[(0, "b", "x@1")].device_s == 0.3 * 1 / 30
    assert rows[(0, "a", "x@1")].kv_page_s == 0.3 * 3 and ledger.totals.device_s == 0.3
    ledger.record_residency(100.0, {"x@1": 4})  # the first call only starts the clock
    ledger.record_residency(160.0, {"x@1": 4, "y@2": 10})
    assert dict(ledger.query(adapters={"x@1"}))[(0, "", "x@1")].adapter_page_s == 240.0
    assert [k for k, _ in ledger.query(tenants={"b"})] == [(0, "b", "x@1")]
    ledger.record_step(4 * 3600.0, 0.1, [StepRow("a", "", 1, 1, 1)])
    ledger.prune(4 * 3600.0)
    assert [k[0] for k, _ in ledger.query()] == [4]  # hours past the retention dropped


async def test_a_merged_deployment_charges_its_version_not_the_base():
    """``serve --merge`` (and the fleet's dedicated replicas) run the version on the base path: its
    requests are still that version's usage."""
    from lorapage.engine.merge_check import merge_and_check

    engine = make_engine()
    try:
        check = await merge_and_check(engine, "acme", ("Hello",))
        assert check.passed
        await engine.run_to_end("Hello there", "acme", tenant="t")
        rows = {(key[1], key[2]): usage for key, usage in engine.usage_rows()}
    finally:
        await engine.close()
    version = engine.admin.catalog.resolve_version("acme")
    assert rows[("t", version)].requests == 1 and rows[("t", version)].output_tokens > 0
    assert ("t", "") not in rows  # nothing of it charged to the base

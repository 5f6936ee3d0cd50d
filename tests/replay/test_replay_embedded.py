"""Replay through the embedded engine (the tiny model and its demo adapters): every request
accounted for once; the driver's open loop never waits on earlier requests, its closed loop keeps
N in flight, and a stop (Ctrl-C) leaves interrupted and unsent requests recorded."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from server_harness import BASE, make_engine

from lorapage.replay.driver import RunOptions, replay
from lorapage.replay.embedded import EmbeddedTarget
from lorapage.traces.records import HTTP_ERROR, INTERRUPTED, NOT_SENT, OK
from lorapage.traces.trace import TraceRequest

pytestmark = pytest.mark.asyncio(loop_scope="module")


def req(t: float, model: str, tenant: str = "t", **kw) -> TraceRequest:
    if "prompt_len" not in kw:
        kw["prompt"] = "Hello"
    return TraceRequest(arrival_s=t, tenant=tenant, model=model, max_tokens=kw.pop("max_tokens", 8), **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    eng = make_engine(max_loras=2, max_resident_loras=2)
    yield eng
    await eng.close()


class Gated:
    """A real target whose request ``hold`` waits for ``gate`` before it is sent on."""

    def __init__(self, inner: EmbeddedTarget, hold: int, gate: asyncio.Event) -> None:
        self.inner, self.hold, self.gate = inner, hold, gate
        self.metrics_note = None
        self.in_flight = self.peak = 0
        self.started: list[int] = []

    def describe(self):
        return self.inner.describe()

    async def start(self):
        return None

    async def close(self):
        return None

    async def send(self, req, index, res, clock):
        self.started.append(index)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if index == self.hold:
                await self.gate.wait()
            await self.inner.send(req, index, res, clock)
        finally:
            self.in_flight -= 1

    async def counters(self):
        return await self.inner.counters()

    async def gauges(self):
        return await self.inner.gauges()


async def test_embedded_replay_accounts_for_every_request(engine):
    trace = [
        req(0.0, "acme", tenant="x", temperature=0.0),
        req(0.01, f"{BASE}:globex", tenant="y", prompt_len=20, system_prompt="p", system_prompt_len=5),
        req(0.02, "initech", tenant="x", seed=1),
        req(0.03, BASE, tenant="y"),
        req(0.04, "nope", tenant="x"),
        req(0.05, "other-base:acme", tenant="x"),
        req(0.06, "acme", tenant="y", prompt_len=600),
    ]
    result = await replay(trace, EmbeddedTarget(engine), RunOptions(timeout_s=60, probe_interval_s=0.02))
    recs = result.records
    assert [r.index for r in recs] == list(range(len(trace)))
    assert [r.status for r in recs] == [200, 200, 200, 200, 404, 404, 400]
    assert [r.outcome for r in recs] == [OK] * 4 + [HTTP_ERROR] * 3
    assert all(r.ttft_s > 0 and r.output_tokens == len(r.chunks_s) >= 1 for r in recs[:4])
    assert recs[1].prompt_tokens == 20 and recs[3].tier == "none"
    assert {r.tier for r in recs[:3]} <= {"gpu", "ram", "disk"}
    assert "nope" in recs[4].error
    assert result.counters_after["lorapage_engine_registered_adapters"] == 3
    key = 'lorapage_tenant_served_output_tokens_total{tenant="x"}'
    assert (
        result.counters_after[key] - result.counters_before.get(key, 0) == recs[0].output_tokens + recs[2].output_tokens
    )


async def test_open_loop_never_waits_for_earlier_requests(engine):
    gate = asyncio.Event()
    target = Gated(EmbeddedTarget(engine), hold=0, gate=gate)
    trace = [req(0.0, "acme"), req(0.05, "globex"), req(0.1, "initech")]

    async def release_when_all_sent():
        while len(target.started) < 3:
            await asyncio.sleep(0.01)
        gate.set()

    releaser = asyncio.create_task(release_when_all_sent())
    # If request 1 waited for request 0 (held until all three are sent), this would never end.
    result = await asyncio.wait_for(replay(trace, target, RunOptions(probe_interval_s=None)), 30)
    await releaser
    assert target.started == [0, 1, 2] and target.peak >= 2
    assert [r.outcome for r in result.records] == [OK] * 3
    assert result.records[0].end_s > result.records[2].sent_s


async def test_closed_loop_keeps_n_in_flight_and_ignores_arrival_times(engine):
    target = Gated(EmbeddedTarget(engine), hold=-1, gate=asyncio.Event())
    trace = [req(1000.0 * i, ("acme", "globex", "initech", BASE)[i % 4]) for i in range(6)]
    result = await asyncio.wait_for(replay(trace, target, RunOptions(concurrency=2, probe_interval_s=None)), 30)
    assert target.peak == 2 and sorted(target.started) == list(range(6))
    assert [r.outcome for r in result.records] == [OK] * 6
    assert all(r.scheduled_s == r.sent_s for r in result.records)


async def test_stop_records_interrupted_and_unsent_requests(engine):
    gate, stop = asyncio.Event(), asyncio.Event()
    target = Gated(EmbeddedTarget(engine), hold=1, gate=gate)  # request 1 never finishes by itself

    class StopAfterFirst:
        def update(self, counts):
            if counts["done"] >= 1 and counts["sent"] >= 2:
                stop.set()

    trace = [req(0.0, "acme"), req(0.01, "globex"), req(600.0, "initech")]
    result = await asyncio.wait_for(replay(trace, target, RunOptions(), stop=stop, progress=StopAfterFirst()), 30)
    assert result.interrupted
    assert [r.outcome for r in result.records] == [OK, INTERRUPTED, NOT_SENT]
    assert result.records[1].sent_s is not None and result.records[1].end_s is not None
    assert result.records[2].sent_s is None and result.records[2].scheduled_s == pytest.approx(600.0, abs=1e-3)

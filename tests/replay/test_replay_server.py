"""Replay against a real lorapage server on 127.0.0.1 (tests/server_harness.py): every request is
accounted for exactly once with its status, the report directory holds its files and keys, and
/metrics is scraped with the admin key before and after."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from server_harness import ADMIN_KEY, BASE, KEYS, server  # noqa: F401

from lorapage.replay.driver import RunOptions, replay
from lorapage.replay.http_target import HttpTarget
from lorapage.replay.keys import Keys
from lorapage.replay.report import build_report, write_report
from lorapage.traces.records import HTTP_ERROR, OK
from lorapage.traces.stats import Slo
from lorapage.traces.trace import TraceRequest

pytestmark = pytest.mark.asyncio(loop_scope="module")


def req(t: float, tenant: str, model: str, **kw) -> TraceRequest:
    if "prompt_len" not in kw and "prompt_ids" not in kw:
        kw["prompt"] = "Hello"
    return TraceRequest(arrival_s=t, tenant=tenant, model=model, max_tokens=kw.pop("max_tokens", 12), **kw)


# (request, expected status): alpha may use acme and globex, beta initech, gamma the base at 2 rpm.
CASES = [
    (req(0.00, "alpha", "acme", temperature=0.0), 200),
    (req(0.02, "alpha", f"{BASE}:globex", prompt_len=40, system_prompt="s", system_prompt_len=10), 200),
    (req(0.04, "beta", "initech", prompt_ids=[72, 105], seed=3), 200),
    (req(0.06, "alpha", BASE, stop=["."]), 200),
    (req(0.08, "gamma", BASE), 200),
    (req(0.10, "gamma", BASE), 200),
    (req(0.12, "gamma", BASE), 429),  # its third request in a minute
    (req(0.14, "alpha", "initech"), 404),  # not alpha's adapter: looks like no adapter at all
    (req(0.16, "beta", "no-such-adapter"), 404),
    (req(0.18, "delta", "acme"), 401),  # the keys file's "*" key is no key of this server
    (req(0.20, "alpha", "acme", max_tokens=600), 400),  # beyond the tiny model's context
    (req(0.22, "alpha", "acme", prompt_len=30), 200),
]
TRACE = [r for r, _ in CASES]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http_run(server):  # noqa: F811
    keys = Keys({**KEYS, "*": "key-nobody"}, admin=ADMIN_KEY)
    target = HttpTarget(server.url, keys)
    await target.start()
    try:
        result = await replay(TRACE, target, RunOptions(speed=2.0, timeout_s=60, probe_interval_s=0.05))
    finally:
        await target.close()
    return result


async def test_every_request_is_accounted_for_once_with_its_status(http_run):
    records = http_run.records
    assert [r.index for r in records] == list(range(len(TRACE)))
    assert [r.status for r in records] == [status for _, status in CASES]
    assert not http_run.interrupted
    for rec, (trace_req, status) in zip(records, CASES):
        assert (rec.tenant, rec.model, rec.max_tokens) == (trace_req.tenant, trace_req.model, trace_req.max_tokens)
        if status == 200:
            assert rec.outcome == OK, rec
            assert rec.output_tokens >= 1 and rec.chunks_s and rec.ttft_s == rec.chunks_s[0]
            assert rec.e2e_s >= rec.chunks_s[-1] >= rec.ttft_s > 0
            assert rec.prompt_tokens >= 1 and rec.sent_s >= rec.scheduled_s
            assert rec.tier == ("none" if rec.model == BASE else rec.tier) and rec.tier in (
                "gpu",
                "ram",
                "disk",
                "none",
            )
        else:
            assert rec.outcome == HTTP_ERROR and rec.error and rec.ttft_s is None, rec
    assert records[1].prompt_tokens == 40 and records[2].prompt_tokens == 2
    assert records[6].error.lower().count("request") >= 1  # the server's 429 message
    # Open loop at speed 2: each request was sent at its trace time / 2, not after the one before.
    for rec, trace_req in zip(records, TRACE):
        assert rec.scheduled_s == pytest.approx(trace_req.arrival_s / 2, abs=1e-3)


async def test_server_counters_scraped_before_and_after(http_run):
    before, after = http_run.counters_before, http_run.counters_after
    assert before is not None and after is not None and http_run.metrics_note is None
    key = 'lorapage_generation_tokens_total{tenant="alpha"}'
    assert after[key] - before.get(key, 0.0) == sum(r.output_tokens for r in http_run.records if r.tenant == "alpha")
    assert http_run.samples and all(set(g) == {"queue_depth", "running"} for _, g in http_run.samples)


async def test_report_directory(http_run, tmp_path):
    report = build_report(TRACE, http_run, meta={"trace": "cases"}, slo=Slo(), weights={"alpha": 2.0})
    out = write_report(tmp_path / "run", http_run.records, report)
    names = {p.name for p in out.iterdir()}
    assert {"records.jsonl", "report.json", "report.md"} <= names
    assert set(report["plots"]) == {"ttft_cdf.png", "latency_over_time.png", "throughput.png", "tenant_share.png"}
    for plot in report["plots"]:
        assert (out / plot).read_bytes().startswith(b"\x89PNG")
    saved = json.loads((out / "report.json").read_text())
    assert set(saved) >= {"meta", "statuses", "throughput", "goodput", "latency", "fairness", "timeline", "server"}
    assert saved["statuses"]["by_status"] == {"200": 7, "429": 1, "503": 0, "other": 4, "none": 0}
    assert set(saved["latency"]["by_tenant"]) == {"alpha", "beta", "gamma", "delta"}
    assert "none" in saved["latency"]["by_tier"]
    assert {"p50", "p90", "p95", "p99"} <= set(saved["latency"]["overall"]["ttft"])
    assert saved["goodput"]["sent"] == len(TRACE)
    assert saved["fairness"]["tenants"]["alpha"]["weight_share"] == pytest.approx(2 / 5)
    assert any("generation_tokens" in k for k in saved["server"]["highlights"])
    lines = (out / "records.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == list(range(len(TRACE)))
    md = (out / "report.md").read_text()
    for heading in ("## Statuses", "## Latency (ms)", "## Fairness", "## Server counters", "## Plots"):
        assert heading in md


async def test_metrics_without_the_admin_key_is_noted(server):  # noqa: F811
    target = HttpTarget(server.url + "/v1/", Keys(dict(KEYS)))
    await target.start()
    try:
        assert await target.counters() is None
        assert "401" in target.metrics_note and "admin key" in target.metrics_note
        assert await target.gauges() == {}
    finally:
        await target.close()

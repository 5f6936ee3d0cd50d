"""The fleet ingress's operations parts, without Ray: its registry's audit trail (a real SQLite
file) read through ``lorapage serve``'s ``/v1/audit`` answer, and the per-request accounting
(tenant SLOs exported as serve's series, the access-log line, a stream recorded when it ends)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorapage.adapters.audit import AuditQuery
from lorapage.adapters.catalog import PreparedVersion
from lorapage.adapters.registry import REGISTRY_FILE, Registry
from lorapage.errors import InvalidRequestError
from lorapage.fleet.accounting import RequestAccounting, until_end
from lorapage.fleet.registry import FleetRegistry
from lorapage.fleet.routing import replica_target, targeted_replica
from lorapage.sampling_params import SamplingParams
from lorapage.server.access_log import AccessLog
from lorapage.server.audit_route import audit_list
from lorapage.server.generation import Job
from lorapage.server.metrics import ServerMetrics
from lorapage.server.slo import SloTargets, SloTracker
from lorapage.server.tenants import key_id
from lorapage.usage.ledger import Usage
from lorapage.usage.report import summed, usage_json

ADMIN = key_id("an-admin-key")
BASE_DIGEST = "b" * 64


def version(n: int) -> PreparedVersion:
    return PreparedVersion(f"file:///adapters/v{n}", f"{n:064x}", BASE_DIGEST, "{}", 8, ("q_proj",), 1024, 1.5)


def test_every_fleet_registry_write_is_audited_as_its_actor(tmp_path: Path) -> None:
    fleet = FleetRegistry(Registry(tmp_path / REGISTRY_FILE))
    fleet.add("acme", "alpha", version(1), activate=True, actor=ADMIN)
    fleet.add("acme", "alpha", version(2), activate=False, actor=ADMIN)
    fleet.set_current("acme", 2, actor=ADMIN)
    fleet.set_pinned("acme@2", True, actor=ADMIN)
    fleet.set_pinned("acme@2", False, actor=ADMIN, outcome="pin undone: its load failed (adapter_load_failed)")
    fleet.record("load", "acme", actor=ADMIN, after={"version": 2})
    fleet.unload("acme@2", actor=ADMIN)
    fleet.remove(fleet.removable("acme@1"), actor=ADMIN)
    fleet.record("tenants_reload", None, actor="sighup", after={"tenants": ["alpha"]})

    rows = fleet.audit(AuditQuery())
    assert [r.action for r in rows] == [
        "tenants_reload", "delete", "unload", "load", "unpin", "pin", "deploy", "register", "register",
    ]  # fmt: skip
    assert {r.actor for r in rows[1:]} == {ADMIN} and rows[0].actor == "sighup"
    assert {r.tenant for r in rows[1:]} == {"alpha"} and rows[0].tenant is None
    assert rows[4].outcome.startswith("pin undone") and rows[5].outcome == "ok"
    assert json.loads(rows[2].after or "") == {"version": 2}

    # Read back through lorapage serve's /v1/audit answer: its filters and paging.
    async def read(query: AuditQuery):
        return await asyncio.to_thread(fleet.audit, query)

    page = asyncio.run(audit_list({"actor": ADMIN, "limit": "3"}, read))
    assert page["has_more"] is True and [e["action"] for e in page["data"]] == ["delete", "unload", "load"]
    assert page["data"][0]["object"] == "audit.entry" and page["data"][0]["actor"] == ADMIN
    rest = asyncio.run(audit_list({"actor": ADMIN, "before_id": str(page["data"][-1]["id"])}, read))
    assert rest["has_more"] is False and [e["action"] for e in rest["data"]][:2] == ["unpin", "pin"]
    deploys = asyncio.run(audit_list({"adapter": "acme", "action": "deploy"}, read))
    assert [e["after"] for e in deploys["data"]] == [{"current": 2}]
    with pytest.raises(InvalidRequestError, match="unknown filter 'who'"):
        asyncio.run(audit_list({"who": "me"}, read))


def job(tenant: str, *, ttft_s: float | None, itl_s: float | None = None, stream: bool = False) -> Job:
    """A generation request as the ingress ends it: arrival at 100, its first token ``ttft_s`` later."""
    out = Job("completion", "acme", "acme@2", tenant, [[1, 2, 3]], SamplingParams(max_tokens=4), stream, False)
    out.arrival, out.adapter_version, out.tier, out.generated = 100.0, 2, "gpu", 4
    if ttft_s is not None:
        out.first_token_at = 100.0 + ttft_s
    if itl_s is not None:
        out.itl_total_s, out.itl_tokens = 3 * itl_s, 3
    return out


def series(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_ingress_judges_requests_as_serve_does_and_exports_its_series(tmp_path: Path) -> None:
    now = time.monotonic()  # fixed: the scrape's window is on the real clock
    tracker = SloTracker({"alpha": SloTargets(ttft_p95_s=1.0, itl_p95_s=0.05, error_rate=0.1)}, window_s=300)
    log_path = tmp_path / "access.jsonl"
    accounting = RequestAccounting(tracker, AccessLog(str(log_path)), clock=lambda: now)
    route = "/v1/completions"
    accounting.finished("POST", route, 200, now - 0.5, job("alpha", ttft_s=0.5, itl_s=0.01))  # good
    accounting.finished("POST", route, 200, now - 0.5, job("alpha", ttft_s=2.0, itl_s=0.01))  # ttft missed
    late = job("alpha", ttft_s=0.2, itl_s=0.01, stream=True)
    late.stream_error = 503  # a started stream that ended with an error event
    accounting.finished("POST", route, 200, now - 0.5, late)
    accounting.finished("POST", route, 429, now - 0.1, job("alpha", ttft_s=None))  # the client's: not judged
    accounting.finished("POST", route, 503, now - 1.0, job("beta", ttft_s=None))  # a tenant without targets
    accounting.finished("GET", "/v1/models", 200, now - 0.01, None)
    assert accounting.access_log is not None
    accounting.access_log.close()

    got = series(ServerMetrics(slo=tracker))
    alpha, beta = (("tenant", "alpha"),), (("tenant", "beta"),)
    assert got[("lorapage_tenant_requests_total", alpha)] == 3
    assert got[("lorapage_tenant_request_errors_total", alpha)] == 1
    assert got[("lorapage_tenant_good_requests_total", alpha)] == 1
    assert got[("lorapage_tenant_goodput_ratio", alpha)] == pytest.approx(1 / 3)
    # ttft: 1 of 3 judged missed, against 5% allowed; errors: 1 of 3 against 10%.
    assert got[("lorapage_tenant_slo_burn_rate", (("slo", "ttft"), *alpha))] == pytest.approx((1 / 3) / 0.05)
    assert got[("lorapage_tenant_slo_burn_rate", (("slo", "error"), *alpha))] == pytest.approx((1 / 3) / 0.1)
    assert got[("lorapage_tenant_slo_target_seconds", (("slo", "ttft"), *alpha))] == 1.0
    assert got[("lorapage_tenant_request_errors_total", beta)] == 1

    lines = [json.loads(text) for text in log_path.read_text().splitlines()]
    assert len(lines) == 6
    first = lines[0]
    assert first["request_id"].startswith("cmpl-") and first["route"] == route and first["status"] == 200
    assert first["tenant"] == "alpha" and first["model"] == "acme" and first["adapter"] == "acme@2"
    assert first["tier"] == "gpu" and first["prompt_tokens"] == 3 and first["output_tokens"] == 4
    assert first["ttft_s"] == 0.5 and first["e2e_s"] == 0.5
    assert lines[3]["status"] == 429 and lines[3]["ttft_s"] is None
    assert lines[5] == {k: lines[5][k] for k in ("ts", "request_id", "method", "route", "status", "e2e_s")}
    assert lines[5]["request_id"] is None and lines[5]["route"] == "/v1/models"


def test_a_stream_is_recorded_once_when_it_ends_or_its_client_goes_away() -> None:
    events: list[str] = []

    async def body():
        try:
            for chunk in (b"a", b"b", b"c"):
                yield chunk
        finally:
            events.append("body closed")  # the ingress releases the quota here

    async def read(take: int) -> list[bytes]:
        got = []
        stream = until_end(body(), lambda: events.append("recorded"))
        async for chunk in stream:
            got.append(chunk)
            if len(got) == take:
                break
        await stream.aclose()  # what Starlette does when the client disconnects
        return got

    assert asyncio.run(read(3)) == [b"a", b"b", b"c"] and events == ["body closed", "recorded"]
    events.clear()
    assert asyncio.run(read(1)) == [b"a"] and events == ["body closed", "recorded"]


def test_replicas_usage_rows_sum_into_one_ledgers() -> None:
    first = [((10, "alpha", "acme@1"), Usage(requests=2, output_tokens=40, device_s=0.5))]
    second = [
        ((9, "", "acme@1"), Usage(adapter_page_s=30.0, load_bytes=1024)),
        ((10, "alpha", "acme@1"), Usage(requests=1, output_tokens=8, device_s=0.25)),
        ((10, "beta", ""), Usage(requests=1, prompt_tokens=5)),
    ]
    rows = summed([first, second, []])
    assert [key for key, _ in rows] == [(9, "", "acme@1"), (10, "alpha", "acme@1"), (10, "beta", "")]
    assert rows[1][1] == Usage(requests=3, output_tokens=48, device_s=0.75)
    parts = [usage_json(first)["total"], usage_json(second)["total"]]
    assert usage_json(rows)["total"] == {k: parts[0][k] + parts[1][k] for k in parts[0]}  # still adds up
    assert first[0][1] == Usage(requests=2, output_tokens=40, device_s=0.5)  # the parts are not changed


def test_a_replica_target_is_never_an_adapter_id() -> None:
    assert targeted_replica(replica_target("ab12cd")) == "ab12cd"
    assert targeted_replica("acme") is None and targeted_replica("") is None

"""A tenant's SLO figures on /metrics as requests end: a stream cut by an error event is a failed
request though its status was 200, and a reloaded tenants file's targets judge what comes next."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import make_engine, running_server

from lorapage.frontend import Access, hash_key
from lorapage.frontend.app import STATE
from lorapage.serve.app import reload_tenants

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "key-slo"
COMP = "/v1/completions"


def _tenants(ttft_s: float) -> str:
    return (
        f'[tenants.t]\nkey_sha256 = ["{hash_key(KEY)}"]\nadapters = ["*"]\n'
        f"slo_ttft_p95_s = {ttft_s}\nslo_error_rate = 0.1\n"
    )


async def _figures(srv) -> dict[str, dict[tuple, float]]:
    async with srv.session.get(srv.url + "/metrics", headers=srv.admin()) as resp:
        text = await resp.text()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("tenant") == "t":
                out.setdefault(s.name, {})[tuple(v for k, v in sorted(s.labels.items()) if k != "tenant")] = s.value
    return out


async def test_reloaded_targets_judge_the_requests_after_the_reload(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(_tenants(3600))
    engine = make_engine()
    try:
        async with running_server(engine, Access.from_file(path), metrics_public=True) as srv:
            body = {"model": "acme", "prompt": "hi", "max_tokens": 4}
            headers = {"Authorization": f"Bearer {KEY}"}
            assert (await srv.post(COMP, body, tenant=None, headers=headers))[0] == 200
            before = await _figures(srv)
            path.write_text(_tenants(0.000001))  # no first token comes within a microsecond
            reload_tenants(srv.app, str(path))
            assert (await srv.post(COMP, body, tenant=None, headers=headers))[0] == 200
            after = await _figures(srv)
    finally:
        await engine.close()
    assert before["lorapage_tenant_slo_target_seconds"] == {("ttft",): 3600.0}
    assert before["lorapage_tenant_slo_burn_rate"] == {("ttft",): 0.0, ("error",): 0.0}
    assert after["lorapage_tenant_slo_target_seconds"] == {("ttft",): 0.000001}
    assert after["lorapage_tenant_slo_burn_rate"][("ttft",)] == pytest.approx((1 / 2) / 0.05)  # 1 of 2 late
    assert after["lorapage_tenant_goodput_ratio"] == {(): 0.5}
    assert after["lorapage_tenant_slo_bad_requests_total"] == {("ttft",): 1.0, ("error",): 0.0}
    assert after["lorapage_tenant_slo_error_budget_ratio"] == {("ttft",): pytest.approx(0.05), ("error",): 0.1}


async def test_a_stream_ended_by_an_error_event_is_a_failed_request(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(_tenants(3600))
    engine = make_engine()
    try:
        async with running_server(engine, Access.from_file(path), metrics_public=True) as srv:
            body = {"model": "acme", "prompt": "hi", "max_tokens": 400, "stream": True}
            headers = {"Authorization": f"Bearer {KEY}"}
            async with srv.session.post(srv.url + COMP, json=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.content.readline()  # the stream has started
                for request_id in list(srv.app[STATE].request_ids):
                    engine.abort(request_id)  # as a shutdown past its grace does
                rest = (await resp.read()).decode()
            assert '"error"' in rest and rest.rstrip().endswith("data: [DONE]")
            figures = await _figures(srv)
    finally:
        await engine.close()
    assert figures["lorapage_tenant_requests_total"] == {(): 1.0}
    assert figures["lorapage_tenant_request_errors_total"] == {(): 1.0}
    assert figures["lorapage_tenant_error_ratio"] == {(): 1.0}
    assert figures["lorapage_tenant_slo_burn_rate"][("error",)] == pytest.approx(1 / 0.1)
    assert figures["lorapage_tenant_goodput_ratio"] == {(): 0.0}

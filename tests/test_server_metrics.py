"""Time-to-first-token and inter-token latency are Prometheus histograms by tenant and adapter tier."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import BASE, make_engine, read_sse, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _samples(text: str, family: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                if s.name == f"{family}_count":
                    out[(s.labels["tenant"], s.labels["adapter_tier"])] = s.value
    return out


async def test_latency_histograms_by_tenant_and_tier():
    engine = make_engine()
    try:
        async with running_server(engine) as srv:
            for tenant, model in (("alpha", "acme"), ("alpha", "acme"), ("beta", "initech"), ("beta", BASE)):
                body = {"model": model, "prompt": "hello", "max_tokens": 6, "temperature": 0, "stream": True}
                async with srv.session.post(srv.url + "/v1/completions", json=body, headers=srv.auth(tenant)) as r:
                    assert r.status == 200
                    async for _ in read_sse(r):
                        pass
            async with srv.session.get(srv.url + "/metrics") as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
                text = await resp.text()
            ttft = _samples(text, "lorapage_time_to_first_token_seconds")
            itl = _samples(text, "lorapage_inter_token_latency_seconds")
            assert ttft[("alpha", "disk")] == 1  # acme's first request found it on disk
            assert ttft[("alpha", "gpu")] == 1  # the second found it resident
            assert ttft[("beta", "disk")] == 1 and ttft[("beta", "none")] == 1
            assert sum(itl.values()) >= 4 and {t for t, _ in itl} == {"alpha", "beta"}
            assert "lorapage_engine_pool_pages_free" in text and "lorapage_requests_total" in text
    finally:
        await engine.close()

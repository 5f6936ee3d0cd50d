"""The alert rules and the dashboard against a real ``lorapage serve``: every ``lorapage_*`` series
their expressions name is on /metrics (over a real socket, after traffic), and a tenant flooded
with requests against an impossibly tight TTFT target crosses the fast-burn threshold while a
tenant with a generous one stays far below it."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from lorapage.frontend import hash_key
from lorapage.testing.serve_process import start_serve

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "lorapage.json"
SERIES = re.compile(r"\blorapage_[a-zA-Z0-9_]+")
KEYS = {"flood": "key-flood", "calm": "key-calm"}
FAST_BURN = 14.4  # the fast-burn page's factor in alerts.yml
# flood: no first token comes within a microsecond, so every answered request misses its TTFT SLO
# (a burn of 1 / 0.05 = 20) however fast or slow the machine; a concurrency cap of 4 turns most of
# a wave away (429s, not judged). calm: an hour is never missed. Both take [defaults]' ITL target.
TENANTS = f"""
[defaults]
slo_itl_p95_s = 3600
slo_error_rate = 0.5

[tenants.flood]
key_sha256 = ["{hash_key(KEYS["flood"])}"]
adapters = ["*"]
max_concurrency = 4
slo_ttft_p95_s = 0.000001

[tenants.calm]
key_sha256 = ["{hash_key(KEYS["calm"])}"]
adapters = ["*"]
slo_ttft_p95_s = 3600
"""


def alert_expressions() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


def named_series(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in SERIES.findall(expr)}


def samples(text: str) -> dict[str, list]:
    """Sample name (``_total``, ``_bucket``... as PromQL names them) -> its samples."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


async def _complete(session: aiohttp.ClientSession, url: str, tenant: str, model: str, stream: bool) -> int:
    body = {"model": model, "prompt": "hello", "max_tokens": 8, "temperature": 0, "stream": stream}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


def test_every_rule_and_panel_is_valid_promql():
    promql = pytest.importorskip("promql_parser")
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    for rule in rules:
        assert {"alert", "expr", "labels", "annotations"} <= rule.keys()
        assert rule["labels"]["severity"] in {"page", "ticket"}
    dashboard = [e.replace("$__rate_interval", "5m").replace("$tenant", ".*") for e in dashboard_expressions()]
    for expr in [r["expr"] for r in rules] + [e for e in dashboard if not e.startswith("label_values(")]:
        promql.parse(expr)  # raises on a syntax or type error (rate() of a vector, a dangling operator)


async def test_alert_and_dashboard_series_exist_and_the_flooded_tenant_burns(tmp_path):
    assert alert_expressions() and dashboard_expressions()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    # One lora slot: the two tenants' adapters take turns in it, so loads and evictions happen.
    args = ("--tenants", str(tenants), "--metrics-public", "--max-loras", "1", "--max-resident-loras", "1")
    with start_serve(*args, under=tmp_path) as served:
        url = served.url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            flood: list[int] = []
            calm: list[int] = []
            for wave in range(3):
                got = await asyncio.gather(
                    _complete(session, url, "calm", "acme", stream=wave % 2 == 0),
                    *(_complete(session, url, "flood", "globex", stream=i % 2 == 0) for i in range(12)),
                )
                calm.append(got[0])
                flood += got[1:]
            assert calm == [200] * 3 and set(flood) == {200, 429}
            async with session.get(url + "/metrics") as resp:
                assert resp.status == 200
                scraped = samples(await resp.text())

    named = named_series(alert_expressions() + dashboard_expressions())
    missing = sorted(name for name in named if not scraped.get(name))
    assert not missing, f"named in alerts.yml or the dashboard but not exported: {missing}"

    burn = {(s.labels["tenant"], s.labels["slo"]): s.value for s in scraped["lorapage_tenant_slo_burn_rate"]}
    assert burn[("flood", "ttft")] > FAST_BURN  # every judged request missed: 1 / 0.05
    assert burn[("calm", "ttft")] == 0.0 and burn[("calm", "itl")] == 0.0
    assert all(value < 1 for (tenant, _), value in burn.items() if tenant == "calm")
    goodput = {s.labels["tenant"]: s.value for s in scraped["lorapage_tenant_goodput_ratio"]}
    assert goodput == {"flood": 0.0, "calm": 1.0}
    refused = {(s.labels["tenant"], s.labels["reason"]) for s in scraped["lorapage_tenant_rejected_requests_total"]}
    assert ("flood", "concurrency") in refused  # the 429s: refused, not judged
    judged = {s.labels["tenant"]: s.value for s in scraped["lorapage_tenant_requests_total"]}
    assert judged == {"flood": flood.count(200), "calm": 3}

    # The incident view: every request offered was admitted or refused (none waits now), and the
    # two tenants' loads into the one slot are charged to them as swap bytes.
    def by_tenant(name: str) -> dict[str, float]:
        totals: dict[str, float] = {}
        for s in scraped[name]:
            totals[s.labels["tenant"]] = totals.get(s.labels["tenant"], 0.0) + s.value
        return totals

    offered, admitted = (
        by_tenant("lorapage_tenant_offered_requests_total"),
        by_tenant("lorapage_tenant_admitted_requests_total"),
    )
    rejected = by_tenant("lorapage_tenant_rejected_requests_total")
    assert offered == {"flood": 36, "calm": 3}
    assert all(offered[t] == admitted[t] + rejected.get(t, 0) for t in offered)
    swap = by_tenant("lorapage_tenant_adapter_load_bytes_total")
    assert swap["flood"] > 0 and swap["calm"] > 0
    running = {s.labels.get("tenant"): s.value for s in scraped["lorapage_engine_running"]}
    assert running == {None: 0, "flood": 0, "calm": 0}

"""/metrics over a real socket: latency histograms by tenant and adapter tier, and the scheduler's
figures (admitted and rejected per tenant, queue wait by kind, VTC counters, per-step histograms,
the tail lanes' use);
per-adapter series with their label set bounded to the top adapters by traffic."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import BASE, make_engine, read_sse, running_server

from lorapage import SamplingParams
from lorapage.adapters.metrics import LABEL_REFRESH_S, AdapterMetrics
from lorapage.engine.stats import EngineStats
from lorapage.frontend.metrics import ENGINE_SERIES, NOT_EXPORTED, ServerMetrics

MAX_TOKENS = 6

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _stream(srv, tenant: str, model: str) -> int:
    body = {"model": model, "prompt": "hello", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    async with srv.session.post(srv.url + "/v1/completions", json=body, headers=srv.auth(tenant)) as r:
        if r.status == 200:
            async for _ in read_sse(r):
                pass
        return r.status


async def _scrape(srv) -> str:
    async with srv.session.get(srv.url + "/metrics", headers=srv.admin()) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        return await resp.text()


def _series(text: str, sample: str) -> dict[tuple, float]:
    """Values of the samples named ``sample``, keyed by their label values (sorted by label name)."""
    return {
        tuple(v for _, v in sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == sample
    }


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
                assert await _stream(srv, tenant, model) == 200
            text = await _scrape(srv)
            ttft = _samples(text, "lorapage_time_to_first_token_seconds")
            itl = _samples(text, "lorapage_inter_token_latency_seconds")
            assert ttft[("alpha", "disk")] == 1  # acme's first request found it on disk
            assert ttft[("alpha", "gpu")] == 1  # the second found it resident
            assert ttft[("beta", "disk")] == 1 and ttft[("beta", "none")] == 1
            assert sum(itl.values()) >= 4 and {t for t, _ in itl} == {"alpha", "beta"}
            assert "lorapage_engine_pool_pages_free" in text and "lorapage_requests_total" in text
    finally:
        await engine.close()


async def test_scheduler_figures_per_tenant_and_per_step():
    engine = make_engine()
    try:
        async with running_server(engine) as srv:
            sent = {"alpha": ["acme", "acme", BASE], "beta": ["initech"], "gamma": [BASE, BASE]}
            for tenant, models in sent.items():
                for model in models:
                    assert await _stream(srv, tenant, model) == 200
            assert await _stream(srv, "gamma", BASE) == 429  # gamma may send two a minute
            text = await _scrape(srv)
        prompt_len = len(engine.tokenizer.encode("hello"))

        admitted = _series(text, "lorapage_tenant_admitted_requests_total")
        assert admitted == {(t,): len(m) for t, m in sent.items()}
        tokens = _series(text, "lorapage_tenant_admitted_prompt_tokens_total")
        assert tokens[("gamma",)] == 2 * prompt_len
        output = _series(text, "lorapage_tenant_served_output_tokens_total")
        assert all(0 < output[(t,)] <= len(m) * MAX_TOKENS for t, m in sent.items())
        assert _series(text, "lorapage_tenant_rejected_requests_total") == {("rpm", "gamma"): 1}
        # Refused on its rate before its body was read: its size is not known, so no tokens are counted.
        assert _series(text, "lorapage_tenant_rejected_tokens_total") == {("rpm", "gamma"): 0}

        waits = _series(text, "lorapage_queue_wait_seconds_count")
        assert waits == {(kind, t): len(m) for t, m in sent.items() for kind in ("adapter_load", "capacity")}
        load_wait = _series(text, "lorapage_queue_wait_seconds_sum")
        assert load_wait[("adapter_load", "alpha")] > 0  # acme was read from disk first
        assert load_wait[("adapter_load", "gamma")] == 0  # the base model never loads
        assert all(v < 30 for v in load_wait.values())

        vtc = _series(text, "lorapage_vtc_counter")
        assert set(vtc) == {("alpha",), ("beta",), ("gamma",)} and all(v > 0 for v in vtc.values())

        steps = _series(text, "lorapage_batch_size_count")[()]
        assert steps >= sum(map(len, sent.values()))  # a step at least per request sent one at a time
        batch = _series(text, "lorapage_batch_size_bucket")
        assert batch[("1.0",)] == steps and _series(text, "lorapage_batch_size_sum")[()] == steps
        distinct = _series(text, "lorapage_batch_distinct_adapters_bucket")
        assert 0 < distinct[("0.0",)] < distinct[("1.0",)] == distinct[("+Inf",)] == steps  # base-only, one adapter
        # One request at a time: each opens a general lane, none a reserved tail lane (nor borrows one).
        assert _series(text, "lorapage_tail_lane_utilization") == {("lent",): 0.0, ("tail",): 0.0}
    finally:
        await engine.close()


async def test_overload_is_a_rejection_of_its_tenant():
    engine = make_engine(max_queue_len=0)  # every request finds the queue full
    try:
        async with running_server(engine) as srv:
            assert await _stream(srv, "beta", "initech") == 503
            text = await _scrape(srv)
        assert _series(text, "lorapage_tenant_rejected_requests_total") == {("queue_full", "beta"): 1}
        assert _series(text, "lorapage_tenant_admitted_requests_total") == {("beta",): 0}
        # A 503 is the server's failure: it counts against the tenant's error ratio (and any error SLO).
        assert _series(text, "lorapage_tenant_request_errors_total") == {("alpha",): 0, ("beta",): 1, ("gamma",): 0}
        assert _series(text, "lorapage_tenant_error_ratio") == {("beta",): 1.0}
    finally:
        await engine.close()


async def test_adapter_labels_are_the_top_k_ids_by_recent_traffic_and_the_rest_other():
    metrics = AdapterMetrics(top_k=3)
    for aid in "abcde":  # the first three ids get their label at once; the rest count as other
        metrics.record_request(f"{aid}@1", "disk", 0.0)
    assert metrics.labelled == {"a", "b", "c"}
    assert metrics.requests[("other", "disk")] == 2
    for _ in range(10):
        metrics.record_request("e@2", "gpu", 1.0)  # e's second version: still adapter "e"
    metrics.record_request("d@1", "gpu", LABEL_REFRESH_S + 1)  # the labelled set is chosen again
    assert metrics.labelled == {"e", "d", "a"}  # by traffic (a, b, c tie: by name)
    assert metrics.requests[("d", "gpu")] == 1 and metrics.requests[("other", "gpu")] == 10
    text = ServerMetrics(adapters=metrics).render().decode()
    labels = {s.labels["adapter"] for s in _family_samples(text, "lorapage_adapter_requests_total")}
    assert labels == {"a", "d", "other"}  # b and c lost their series; e's requests were counted as other


async def test_a_load_is_charged_to_the_tenant_whose_request_found_the_adapter_outside_the_pool():
    metrics = AdapterMetrics(top_k=3)
    metrics.record_request("a@1", "disk", 0.0, "acme")  # its load starts: charged to acme
    metrics.record_request("a@1", "loading", 0.1, "globex")  # waits on acme's load: not charged again
    metrics.record_load("a@1", "disk", 0.2, nbytes=1000, now=0.2)
    metrics.record_request("a@1", "gpu", 0.3, "globex")  # a hit: no load
    metrics.record_load("b@1", "ram", 0.1, nbytes=500, now=0.4)  # a pin's load: nobody waited on it
    metrics.record_request("a@1", "ram", 1.0, "globex")  # evicted meanwhile: globex's request reloads it
    metrics.record_load("a@1", "ram", 0.1, nbytes=1000, now=1.1)
    assert metrics.load_bytes_by_tenant == {"acme": 1000, "globex": 1000}
    text = ServerMetrics(adapters=metrics).render().decode()
    assert _series(text, "lorapage_tenant_adapter_load_bytes_total") == {("acme",): 1000, ("globex",): 1000}


async def test_adapter_series_are_bounded_by_the_top_k():
    """Three adapters, K = 2: the third's requests, loads and evictions count as other."""
    engine = make_engine(metrics_top_adapters=2, max_loras=1, max_resident_loras=1)
    try:
        for model in ("acme", "globex", "initech"):
            async for out in engine.generate("hello", model, SamplingParams(max_tokens=2), tenant="alpha"):
                pass
        text = ServerMetrics(engine.stats, adapters=engine.debug.adapter_metrics).render().decode()
    finally:
        await engine.close()
    cold = {("acme", "disk"): 1, ("globex", "disk"): 1, ("other", "disk"): 1}
    assert _series(text, "lorapage_adapter_requests_total") == cold
    assert _series(text, "lorapage_adapter_loads_total") == cold
    assert _series(text, "lorapage_adapter_evictions_total") == {("acme",): 1, ("globex",): 1}  # one slot
    assert _series(text, "lorapage_adapter_load_seconds_count")[("disk",)] == 3
    assert _series(text, "lorapage_adapter_pinned_pages") == {(): 0}
    assert _series(text, "lorapage_adapter_download_bytes_total") == {}  # local files only


def _family_samples(text: str, sample: str):
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == sample]


async def test_every_engine_stats_field_is_exported_once_or_named_as_not():
    """The server's table covers EngineStats: each field read by one series, unless listed as not
    exported; a series keeps the name its field always had (``lorapage_engine_<key>``)."""
    read = [s.field for s in ENGINE_SERIES if s.field] + [s.by_tenant for s in ENGINE_SERIES if s.by_tenant]
    assert sorted(read + sorted(NOT_EXPORTED)) == sorted(f.name for f in dataclasses.fields(EngineStats))
    for series in ENGINE_SERIES:
        key = series.field or str(series.by_tenant).removesuffix("_by_tenant")
        assert series.name == f"lorapage_engine_{key}" and series.help


async def test_engine_series_read_one_stats_call_and_name_each_family_once():
    """The overall prefix-cache hit rate and each tenant's share one family: one HELP line per name
    (a second one is invalid exposition text)."""
    engine = make_engine()
    try:
        for tenant in ("alpha", "beta"):
            async for _ in engine.generate("hello", "acme", SamplingParams(max_tokens=2), tenant=tenant):
                pass
        stats = engine.stats()
        text = ServerMetrics(lambda: stats).render().decode()
    finally:
        await engine.close()
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP lorapage_engine_")]
    assert len(helps) == len(set(helps)) == len(ENGINE_SERIES)
    rate = _series(text, "lorapage_engine_prefix_cache_hit_rate")
    assert rate == {
        (): stats.prefix_cache_hit_rate,
        **{(t,): r for t, r in stats.prefix_cache_hit_rate_by_tenant.items()},
    }
    assert set(rate) == {(), ("alpha",), ("beta",)}
    assert _series(text, "lorapage_engine_kv_pages_held") == {("alpha",): 0, ("beta",): 0}  # nothing runs
    assert _series(text, "lorapage_engine_pool_pages_total") == {(): stats.pool_pages_total}

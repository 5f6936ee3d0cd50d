"""The report's arithmetic on hand-computed records: percentiles, latency, goodput under SLOs,
statuses, throughput, fairness and the timeline; and the /metrics parsing it diffs."""

from __future__ import annotations

import pytest

from lorapage.replay.scrape import delta, highlights, parse_prometheus
from lorapage.traces import stats
from lorapage.traces.records import HTTP_ERROR, NOT_SENT, OK, STREAM_ERROR, Record


def rec(index, *, tenant="a", tier="gpu", outcome=OK, status=200, sent=0.0, chunks=(), end=None, prompt=10, out=None):
    chunks = list(chunks)
    if end is None and chunks:
        end = sent + chunks[-1]
    return Record(
        index=index,
        tenant=tenant,
        model="m",
        tier=tier,
        outcome=outcome,
        status=status,
        scheduled_s=sent,
        sent_s=None if outcome == NOT_SENT else sent,
        end_s=end,
        ttft_s=chunks[0] if chunks else None,
        e2e_s=(end - sent) if outcome == OK and end is not None else None,
        prompt_tokens=prompt if outcome in (OK, STREAM_ERROR) else 0,
        output_tokens=len(chunks) if out is None else out,
        max_tokens=16,
        chunks_s=chunks,
    )


def test_percentile_interpolates_between_closest_ranks():
    assert stats.percentile([4, 1, 3, 2], 50) == 2.5
    assert stats.percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert stats.percentile([0, 100], 99) == pytest.approx(99)
    assert stats.percentile([0, 100], 0) == 0 and stats.percentile([0, 100], 100) == 100
    assert stats.percentile([7], 95) == 7
    assert stats.percentile([], 50) is None


def test_summarize():
    s = stats.summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s == {"count": 5, "mean": 3.0, "p50": 3.0, "p90": 4.6, "p95": pytest.approx(4.8), "p99": 4.96, "max": 5.0}
    assert stats.summarize([])["p95"] is None


def test_latency_uses_successful_requests_and_every_gap():
    records = [
        rec(0, chunks=[0.2, 0.3, 0.5]),  # gaps 0.1, 0.2; e2e 0.5; tpot (0.5 - 0.2) / 2
        rec(1, chunks=[0.4, 0.6]),  # gap 0.2; e2e 0.6; tpot 0.2
        rec(2, outcome=STREAM_ERROR, chunks=[0.1, 5.0]),  # ignored: not complete
        rec(3, outcome=HTTP_ERROR, status=429),
    ]
    lat = stats.latency(records)
    assert lat["ttft"]["count"] == 2 and lat["ttft"]["mean"] == pytest.approx(0.3)
    assert lat["itl"]["count"] == 3 and lat["itl"]["p50"] == pytest.approx(0.2)
    assert lat["itl"]["max"] == pytest.approx(0.2) and lat["itl"]["mean"] == pytest.approx(0.5 / 3)
    assert lat["e2e"]["p50"] == pytest.approx(0.55)
    assert lat["tpot"]["mean"] == pytest.approx((0.15 + 0.2) / 2)


def hand_run() -> list[Record]:
    return [
        rec(0, tier="gpu", chunks=[0.5, 0.6]),  # good: 0.5 <= 1.0
        rec(1, tier="gpu", chunks=[1.2, 1.3]),  # bad: 1.2 > 1.0 for a resident adapter
        rec(2, tier="disk", sent=1.0, chunks=[1.5, 1.6, 1.7]),  # good: 1.5 <= 2.0 (cold)
        rec(3, tier="ram", sent=1.0, chunks=[2.5, 2.6]),  # bad: 2.5 > 2.0
        rec(4, tier="none", sent=2.0, chunks=[0.9]),  # good: base model, resident SLO
        rec(5, tier="unknown", outcome=HTTP_ERROR, status=429, sent=2.0, end=2.01),
        rec(6, tier="unknown", outcome=HTTP_ERROR, status=503, sent=2.0, end=2.01),
        rec(7, tier="gpu", outcome=STREAM_ERROR, sent=3.0, chunks=[0.1]),  # fast but broken: not good
        rec(8, tier="unknown", outcome=HTTP_ERROR, status=404, sent=3.0, end=3.0),
        rec(9, outcome=NOT_SENT, status=0, sent=9.0),
    ]


def test_goodput_counts_successes_within_their_tier_target():
    records = hand_run()
    duration = stats.span_s(records)
    assert duration == pytest.approx(3.6)  # first sent 0.0, last end 1.0 + 2.6 (record 3)
    g = stats.goodput(records, stats.Slo(ttft_s=1.0, ttft_cold_s=2.0), duration)
    assert (g["good"], g["sent"]) == (3, 9)  # the not-sent request is not counted
    assert g["fraction"] == pytest.approx(3 / 9)
    assert g["requests_per_s"] == pytest.approx(3 / 3.6)
    assert g["output_tokens_per_s"] == pytest.approx((2 + 3 + 1) / 3.6)
    assert g["by_tier"]["gpu"] == {
        "good": 1,
        "sent": 3,
        "fraction": pytest.approx(1 / 3),
        "requests_per_s": pytest.approx(1 / 3.6),
        "output_tokens_per_s": pytest.approx(2 / 3.6),
    }
    assert g["by_tier"]["disk"]["good"] == 1 and g["by_tier"]["ram"]["good"] == 0
    assert g["by_tier"]["none"]["fraction"] == 1.0 and g["by_tier"]["unknown"]["fraction"] == 0.0
    strict = stats.goodput(records, stats.Slo(ttft_s=0.6, ttft_cold_s=0.6), duration)
    assert strict["good"] == 1  # only record 0


def test_statuses_and_throughput():
    records = hand_run()
    s = stats.statuses(records)
    assert s["by_status"] == {"200": 6, "429": 1, "503": 1, "other": 1, "none": 1}
    assert s["by_outcome"] == {"http_error": 3, "not_sent": 1, "ok": 5, "stream_error": 1}
    t = stats.throughput(records, 3.6)
    assert t["requests_per_s"] == pytest.approx(5 / 3.6)
    assert t["output_tokens_per_s"] == pytest.approx((2 + 2 + 3 + 2 + 1 + 1) / 3.6)  # partial answers count
    assert t["prompt_tokens_per_s"] == pytest.approx(50 / 3.6)


def test_fairness_shares_and_jain_index():
    records = [
        rec(0, tenant="a", chunks=[0.1] * 10, prompt=10),  # a served 20 tokens
        rec(1, tenant="b", chunks=[0.1] * 50, prompt=10),  # b served 60
        rec(2, tenant="b", outcome=HTTP_ERROR, status=429),  # nothing served
    ]
    f = stats.fairness(records, demand={"a": 40, "b": 60}, weights={"a": 1.0, "b": 3.0})
    a, b = f["tenants"]["a"], f["tenants"]["b"]
    assert (a["weight_share"], b["weight_share"]) == (0.25, 0.75)
    assert (a["demand_share"], b["demand_share"]) == (0.4, 0.6)
    assert (a["served_share"], b["served_share"]) == (0.25, 0.75)
    assert (a["served_tokens"], b["served_tokens"]) == (20, 60)
    assert a["served_over_weight"] == 1.0 and a["served_over_demand"] == pytest.approx(0.625)
    assert f["jain_index"] == pytest.approx(1.0)
    skewed = stats.fairness(records, demand={"a": 40, "b": 60}, weights={})  # equal weights
    x = [0.25 / 0.5, 0.75 / 0.5]
    assert skewed["jain_index"] == pytest.approx(sum(x) ** 2 / (2 * sum(v * v for v in x)))
    assert stats.jain_index([1, 0, 0, 0]) == 0.25


def test_timeline_bins():
    records = [
        rec(0, sent=0.2, chunks=[0.3, 0.6, 1.4]),  # tokens at 0.5, 0.8, 1.6; ends 1.6
        rec(1, sent=1.1, chunks=[0.2]),  # token at 1.3; ends 1.3
        rec(2, sent=1.5, outcome=HTTP_ERROR, status=429, end=1.5),
    ]
    tl = stats.timeline(records, 1.0, samples=[(0.5, {"queue_depth": 2}), (0.9, {"queue_depth": 4})])
    assert tl["t"] == [0.0, 1.0]
    assert tl["sent_per_s"] == [1, 2]
    assert tl["completed_per_s"] == [0, 2]
    assert tl["output_tokens_per_s"] == [2, 2]
    assert tl["ttft_p50"] == [0.3, 0.2]
    assert tl["in_flight"] == [1, 1]  # at 0.5 record 0; at 1.5 record 0 (record 1 ended at 1.3)
    assert tl["server"] == {"queue_depth": [3.0, None]}


def test_prometheus_parsing_and_delta():
    text = """# HELP lorapage_engine_preemptions Engine.stats()['preemptions']
# TYPE lorapage_engine_preemptions gauge
lorapage_engine_preemptions 2.0
lorapage_requests_total{route="/v1/completions",status="200"} 5.0
lorapage_requests_created{route="/v1/completions",status="200"} 1.7e9
lorapage_time_to_first_token_seconds_bucket{adapter_tier="gpu",le="0.1",tenant="a"} 3.0
lorapage_time_to_first_token_seconds_count{adapter_tier="gpu",tenant="a b"} 4.0
weird{label="x } y"} 1
"""
    snap = parse_prometheus(text)
    assert snap == {
        "lorapage_engine_preemptions": 2.0,
        'lorapage_requests_total{route="/v1/completions",status="200"}': 5.0,
        'lorapage_time_to_first_token_seconds_count{adapter_tier="gpu",tenant="a b"}': 4.0,
        'weird{label="x } y"}': 1.0,
    }
    after = {**snap, "lorapage_engine_preemptions": 5.0, "lorapage_engine_pool_pages_kv": 7.0}
    d = delta(snap, after)
    assert d["lorapage_engine_preemptions"] == 3.0 and d["lorapage_engine_pool_pages_kv"] == 7.0
    assert d['weird{label="x } y"}'] == 0.0
    assert highlights(snap, after) == ["lorapage_engine_pool_pages_kv", "lorapage_engine_preemptions"]

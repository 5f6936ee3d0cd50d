"""Traces: the JSONL format and its errors, the seeded generator (deterministic; Zipf exponent,
arrival rate, burstiness, diurnal ramp and shared system prompts as asked), the importers on
hand-written rows, synthetic prompts and the keys file."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lorapage.replay.generator import GenConfig, generate
from lorapage.replay.importers import ImportOptions, import_azure, import_burstgpt, parse_azure_timestamp
from lorapage.replay.keys import Keys, KeysError
from lorapage.replay.population import Population
from lorapage.replay.prompts import prompt_for
from lorapage.traces.trace import TraceError, TraceRequest, read_trace, write_trace

SAMPLES = Path(__file__).resolve().parents[2] / "bench" / "traces"


def test_trace_roundtrip(tmp_path):
    reqs = [
        TraceRequest(arrival_s=0.0, tenant="a", model="base", max_tokens=4, prompt="hi", temperature=0.0),
        TraceRequest(arrival_s=0.5, tenant="b", model="base:x", max_tokens=8, prompt_ids=[1, 2, 3], seed=3),
        TraceRequest(
            arrival_s=1.5, tenant="b", model="x", max_tokens=8, prompt_len=30, system_prompt="s", system_prompt_len=10
        ),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, reqs) == 3
    assert read_trace(path) == reqs
    assert read_trace(path, limit=2) == reqs[:2]
    assert '"temperature":0.0' in path.read_text().splitlines()[0]
    assert "top_p" not in path.read_text()  # unset fields are not written


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"arrival_s": 0, "tenant": "a", "model": "m", "prompt": "x"}', ["max_tokens"]),
        ('{"arrival_s": 0, "tenant": "a", "model": "m", "max_tokens": 1}', ["exactly one", "none"]),
        ('{"arrival_s": 0, "tenant": "a", "model": "m", "max_tokens": 1, "prompt": "x", "prompt_len": 3}', ["exactly"]),
        ('{"arrival_s": -1, "tenant": "a", "model": "m", "max_tokens": 1, "prompt": "x"}', ["arrival_s"]),
        ('{"arrival_s": 0, "tenant": "a", "model": "m", "max_tokens": 0, "prompt": "x"}', ["max_tokens"]),
        ('{"arrival_s": 0, "tenant": "a", "model": "m", "max_tokens": 1, "prompt": "x", "colour": 1}', ["colour"]),
        ('{"arrival_s": 0, "tenant": "a", "model": "m", "max_tokens": "9", "prompt": "x"}', ["max_tokens", "int"]),
        (
            '{"arrival_s": 0, "tenant": "a", "model": "m", "max_tokens": 1, "prompt_len": 5, "system_prompt_len": 9}',
            ["system_prompt_len"],
        ),
        ("not json", ["JSON"]),
    ],
)
def test_trace_errors_name_line_and_field(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    good = '{"arrival_s": 0, "tenant": "a", "model": "m", "max_tokens": 1, "prompt": "x"}'
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert f"{path}:3:" in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_empty_trace_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(path)


def test_generator_is_deterministic_for_a_seed():
    cfg = GenConfig(seed=7, scale=0.02, duration_s=30)
    a, b = generate(cfg), generate(cfg)
    assert a == b and len(a) > 10
    c = generate(GenConfig(seed=8, scale=0.02, duration_s=30))
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    # Changing the lengths leaves the arrivals and the adapters as they were (one stream each).
    d = generate(GenConfig(seed=7, scale=0.02, duration_s=30, output_mean=20))
    assert [(r.arrival_s, r.model) for r in d] == [(r.arrival_s, r.model) for r in a]


def test_generator_zipf_exponent_and_rate_within_tolerance():
    alpha, rate, duration = 1.2, 40.0, 500.0
    trace = generate(GenConfig(seed=1, rate=rate, duration_s=duration, adapters=200, zipf_alpha=alpha, tenants=10))
    assert len(trace) / duration == pytest.approx(rate, rel=0.03)  # 20,000 arrivals: sd 0.7%
    counts = Counter(r.model for r in trace)
    ranks = np.arange(1, 31)  # the 30 most popular ranks, where counts are large
    freq = np.array([counts[f"a{i:03d}"] for i in range(30)], dtype=float)
    slope = np.polyfit(np.log(ranks), np.log(freq), 1)[0]
    assert -slope == pytest.approx(alpha, abs=0.1)
    times = np.array([r.arrival_s for r in trace])
    assert (np.diff(times) >= 0).all() and times[0] > 0
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # Poisson


def test_generator_bursty_and_diurnal_arrivals():
    bursty = generate(GenConfig(seed=2, rate=20, num_requests=20_000, duration_s=None, cv=2.0, adapters=5))
    gaps = np.diff([r.arrival_s for r in bursty])
    assert len(bursty) == 20_000
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)
    assert len(bursty) / bursty[-1].arrival_s == pytest.approx(20, rel=0.1)
    period = 400.0
    ramp = GenConfig(seed=3, rate=20, duration_s=period, diurnal_amplitude=0.8, diurnal_period_s=period, adapters=5)
    t = np.array([r.arrival_s for r in generate(ramp)])
    middle = ((t > period / 4) & (t < 3 * period / 4)).sum()
    # Expected arrivals: the integral of 20 (1 - 0.8 cos(2 pi t / P)) over the middle half and the rest.
    expected_middle = 20 * (period / 2 + 0.8 * period / math.pi)
    assert middle == pytest.approx(expected_middle, rel=0.05)
    assert len(t) == pytest.approx(20 * period, rel=0.05)


def test_generator_shares_system_prompts_per_tenant():
    cfg = GenConfig(seed=4, scale=0.05, duration_s=200, shared_fraction=0.3, system_prompt_len=20, prompt_max=50)
    trace = generate(cfg)
    shared = [r for r in trace if r.system_prompt]
    assert len(shared) / len(trace) == pytest.approx(0.3, abs=0.05)
    assert all(r.system_prompt.startswith(r.tenant + "-sys") for r in shared)
    assert all(r.system_prompt_len == 20 and r.prompt_len > 20 for r in shared)
    assert all(r.max_tokens == r.output_len and 1 <= r.max_tokens <= cfg.output_max for r in trace)
    assert max(r.prompt_len for r in trace if not r.system_prompt) <= 50
    same = [i for i, r in enumerate(trace) if r.system_prompt == shared[0].system_prompt][:2]
    p, q = (prompt_for(trace[i], i) for i in same)
    assert p[:20] == q[:20] and p[20:] != q[20:]
    assert len(p) == trace[same[0]].prompt_len and all(32 <= t < 127 for t in p)
    assert prompt_for(trace[same[0]], same[0]) == p  # the same prompt every replay


def test_population_gives_tenants_their_weight_share():
    pop = Population.make(num_tenants=5, num_adapters=2000, zipf_alpha=0.8, tenant_weights=[5, 2, 1, 1, 1])
    share = np.zeros(5)
    for p, owner in zip(pop.adapter_p, pop.owners):
        share[owner] += p
    assert share == pytest.approx([0.5, 0.2, 0.1, 0.1, 0.1], abs=0.01)
    tenants, models = pop.draw(np.random.default_rng(0), 1000)
    owner_of = {a: pop.tenants[o] for a, o in zip(pop.adapters, pop.owners)}
    assert all(owner_of[m] == t for t, m in zip(tenants, models))
    base = Population.make(num_tenants=3, num_adapters=10, zipf_alpha=1.0, base_fraction=1.0, base_name="llama")
    assert set(base.draw(np.random.default_rng(0), 50)[1]) == {"llama"}


def test_azure_timestamps():
    t0 = parse_azure_timestamp("2023-11-16 18:15:46.6805900")
    assert parse_azure_timestamp("2023-11-16 18:15:47.6805900") - t0 == pytest.approx(1.0)
    assert parse_azure_timestamp("2023-11-16 18:15:46.68059") == pytest.approx(t0)
    assert parse_azure_timestamp("2023-11-16 18:15:46") == pytest.approx(t0 - 0.68059)
    assert parse_azure_timestamp("2023-11-16T18:15:46.680590Z") == pytest.approx(t0)
    assert parse_azure_timestamp("2023-11-16 19:15:46.680590+01:00") == pytest.approx(t0)
    with pytest.raises(ValueError):
        parse_azure_timestamp("yesterday")


def test_import_azure_sample():
    got = import_azure(SAMPLES / "azure_sample.csv", ImportOptions(adapters=20, tenants=4, seed=1))
    assert got.rows == 10 and got.skipped == {"no_output": 1}
    reqs = got.requests
    assert [r.arrival_s for r in reqs] == [0.0, 0.48123, 1.25, 1.265, 2.5, 3.1, 4.75, 5.0, 6.33]  # sorted
    assert [(r.prompt_len, r.max_tokens) for r in reqs[:5]] == [(120, 24), (64, 12), (310, 40), (48, 8), (150, 16)]
    assert all(r.output_len == r.max_tokens for r in reqs)
    again = import_azure(SAMPLES / "azure_sample.csv", ImportOptions(adapters=20, tenants=4, seed=1))
    assert again.requests == reqs  # the tenant / adapter draw is seeded
    clipped = import_azure(SAMPLES / "azure_sample.csv", ImportOptions(prompt_max=100, output_max=10, limit=3))
    assert [(r.prompt_len, r.max_tokens) for r in clipped.requests] == [(100, 10), (64, 10), (100, 10)]
    assert clipped.skipped["over_limit"] == 6
    window = import_azure(SAMPLES / "azure_sample.csv", ImportOptions(start_s=1.0, duration_s=2.0))
    assert [r.arrival_s for r in window.requests] == [0.0, 0.015, 1.25]  # rows at 1.25, 1.265, 2.5, from 0


def test_import_burstgpt_sample_skips_failures():
    got = import_burstgpt(SAMPLES / "burstgpt_sample.csv", ImportOptions(adapters=3, tenants=2))
    assert got.rows == 8 and got.skipped == {"failed": 1}
    assert [(r.arrival_s, r.prompt_len, r.max_tokens) for r in got.requests[:4]] == [
        (0.0, 472, 18),
        (1.0, 86, 120),
        (3.0, 240, 64),
        (4.0, 63, 31),
    ]
    assert {r.model for r in got.requests} <= {"a0", "a1", "a2"} and {r.tenant for r in got.requests} <= {"t0", "t1"}


def test_importers_name_the_bad_row(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,5\n")
    with pytest.raises(TraceError, match="GeneratedTokens"):
        import_azure(path, ImportOptions())
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5,7\n2023-11-16 18:00:01,five,7\n")
    with pytest.raises(TraceError, match=r"x.csv:3: ContextTokens must be a number"):
        import_azure(path, ImportOptions())
    path.write_text("Timestamp,Request tokens,Response tokens\nsoon,1,2\n")
    with pytest.raises(TraceError, match=r"x.csv:2: Timestamp"):
        import_burstgpt(path, ImportOptions())
    path.write_text(" timestamp , request tokens , response tokens \n 2.5 , 10 , 3 \n")  # loose header match
    assert [(r.prompt_len, r.max_tokens) for r in import_burstgpt(path, ImportOptions()).requests] == [(10, 3)]


def test_keys_file(tmp_path):
    js = tmp_path / "keys.json"
    js.write_text('{"tenants": {"a": "ka", "*": "kany"}, "admin": "kadmin"}')
    keys = Keys.load(js)
    assert (keys.key_for("a"), keys.key_for("zz"), keys.admin) == ("ka", "kany", "kadmin")
    toml = tmp_path / "keys.toml"
    toml.write_text('admin = "kadmin"\n[tenants]\na = "ka"\n')
    keys = Keys.load(toml)
    assert keys.key_for("a") == "ka" and keys.key_for("b") is None
    with pytest.raises(KeysError, match="b, c"):
        keys.check_covers(["a", "b", "c"])
    js.write_text('{"a": "ka"}')
    with pytest.raises(KeysError, match="expected"):
        Keys.load(js)

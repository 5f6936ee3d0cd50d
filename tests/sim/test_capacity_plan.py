"""``lorapage plan`` against seed 001's 7B walk-through, and its Little's-law arithmetic.

Seed 001: rank 16 on the attention and MLP matrices of a 7B (32 layers, hidden 4,096, MLP
11,008) is 39,976,960 values, 80 MB in 16-bit; 5,000 of them 400 GB, merged copies 70 TB; of an
80 GB GPU, 14 GB base, 524,288 bytes of KV per token x 32 requests x 2,000 tokens = 33.6 GB, 4 GB
working memory, 28.4 GB or 355 adapters left; 40 requests/s x 250 output tokens = 10,000 tokens/s
at 640 per replica = 15.6, 30,000 prompt tokens/s at 8,000 = 3.8, 19.4 -> 26 replicas with 30%
headroom; two owners: 10,000 placements / 26 = 385 adapters per replica, 31 GB of host RAM.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lorapage.capacity.cli import main
from lorapage.capacity.plan import distinct_in_flight, resident_per_replica
from lorapage.replay.generator import GenConfig, generate
from lorapage.traces.trace import write_trace

SEED_7B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "torch_dtype": "float16",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama-7b")
    (path / "config.json").write_text(json.dumps(SEED_7B))
    return path


def plan_text(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def row(text: str, label: str) -> str:
    """The text after a row's label (the first row that starts with it)."""
    return next(line.strip()[len(label) :].strip() for line in text.splitlines() if line.strip().startswith(label))


def test_the_seed_7b_walkthrough(model_dir, capsys):
    """The seed rounds the base to 14 GB (7B x 2 bytes): given that, every figure is the seed's."""
    text = plan_text(capsys, "--model", str(model_dir), "--base-gb", "14", "--rate", "40", "--adapters", "5000")
    assert row(text, "per layer") == "1,249,280 values (r x (d_in + d_out) per module)"
    assert row(text, "whole adapter") == "39,976,960 values = 80.0 MB"
    assert row(text, "all 5,000 adapters") == "400 GB; merged copies 5,000 x 14.0 GB = 70.0 TB"
    assert row(text, "KV cache") == "33.6 GB = 524,288 bytes per token x 32 sequences x 2,000 tokens"
    assert row(text, "working memory") == "4.00 GB"
    assert row(text, "left for adapters") == "28.4 GB = 355 adapters"
    assert row(text, "decode") == "10,000 tokens/s / 640 per replica (32 rows / 50.0 ms per step) = 15.6"
    assert row(text, "prefill") == "30,000 tokens/s / 8,000 per replica = 3.75"
    assert row(text, "total") == "19.4 -> 26 replicas with 30% headroom"
    assert row(text, "placement") == "2 owners x 5,000 adapters / 26 replicas = 385 adapters per replica = 30.8 GB"
    # lorapage's pool: 8.39 MB pages (16 tokens of KV in every layer); the adapter rounds up to 10.
    assert row(text, "as lorapage's pool") == (
        "7,390 pages of 8.39 MB (16 tokens of KV): 4,000 for KV, 338 adapters of 10 pages"
    )
    assert "tier shared" in row(text, "projected cost")


def test_the_base_from_its_shape_and_the_json(model_dir, capsys):
    """Without --base-gb the base is its parameters x 2 bytes: 13.5 GB, so 362 adapters fit."""
    text = plan_text(capsys, "--model", str(model_dir / "config.json"))
    assert row(text, "base weights") == "13.5 GB (6,738,415,616 parameters)"
    assert row(text, "left for adapters") == "29.0 GB = 362 adapters"
    figures = json.loads(plan_text(capsys, "--model", str(model_dir), "--json"))["plan"]
    assert figures["adapter_values"] == 39_976_960 and figures["replicas"] == 26
    assert figures["kv_bytes_per_token"] == 524_288 and figures["adapters_fit"] == 362
    assert figures["cost"]["projected_cost_pct"] == pytest.approx(38.72, abs=0.01)
    duration = 750 / 8000 + 250 * 0.050
    assert figures["duration_s"] == pytest.approx(duration)
    assert figures["in_flight"] == pytest.approx(40 * duration)
    assert figures["cache_adapters"] == pytest.approx(2 * figures["resident_per_replica"])


def test_the_envelope_flags_set_the_tier(model_dir, capsys):
    text = plan_text(capsys, "--model", str(model_dir), "--rank", "64", "--json")
    assert json.loads(text)["plan"]["tier"] == "dedicated"  # rank 64 is outside the default all:16
    text = plan_text(capsys, "--model", str(model_dir), "--modules", "attention", "--shared-max-cost-pct", "10")
    assert row(text, "projected cost").endswith("tier dedicated")  # 16.3% at batch 64 on the 7B
    text = plan_text(capsys, "--model", str(model_dir), "--modules", "attention", "--rank", "8")
    assert row(text, "projected cost").startswith("+8.1% decode bytes at batch 64")


def test_littles_law():
    """One adapter at rate 1/s with requests of 2 s has Poisson(2) in flight; the seed 000 form
    (distinct arrival rate x duration) is its limit when no two requests share an adapter."""
    assert distinct_in_flight(1.0, 2.0, [1.0]) == pytest.approx(1 - math.exp(-2))
    spread = [1 / 100_000] * 100_000  # every request on an adapter of its own
    assert distinct_in_flight(3.0, 60.0, spread) == pytest.approx(180, rel=1e-3)  # seed 000 R3: 3/s x 60 s
    # On one of 10 replicas: rare adapters on their 2 owners, a hot one spread by its load.
    assert resident_per_replica(3.0, 60.0, spread, 10, 2) == pytest.approx(18, rel=1e-3)
    hot = resident_per_replica(10.0, 10.0, [1.0], 10, 2)  # 100 in flight at a mean of 10 per replica
    assert hot == pytest.approx(1 - math.exp(-10))  # on every replica: 10 in flight on each


def test_a_trace_sets_the_workload_and_the_simulator_finds_replicas(model_dir, tmp_path, capsys):
    """The workload read from a trace (rate, lengths, popularity), and the fleet simulator's
    fewest replicas for the seed's SLO over the same trace, beside the arithmetic's."""
    trace = generate(GenConfig(seed=3, rate=4.0, duration_s=40.0, adapters=200, prompt_mean=300, output_mean=60))
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace)
    text = plan_text(capsys, "--model", str(model_dir), "--trace", str(path), "--find-replicas", "8", "--warmup", "5")
    workload = next(line for line in text.splitlines() if line.startswith("workload:"))
    rate = len(trace) / (trace[-1].arrival_s - trace[0].arrival_s)
    assert f"{rate:g} requests/s" in workload
    assert f"{len({r.model for r in trace}):,} adapters" in workload
    fewest = row(text, "fewest meeting the SLO")
    assert fewest.isdigit() and 1 <= int(fewest) <= 8
    assert "p95 TTFT" in row(text, f"at {row(text, 'total').split()[2]} replicas")


def test_the_command_is_registered():
    out = subprocess.run([sys.executable, "-m", "lorapage.cli", "--help"], capture_output=True, text=True, check=True)
    assert "plan" in out.stdout and "sizing" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "lorapage.cli", "plan", "--model", "/nonexistent"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.startswith("lorapage plan: --model /nonexistent")


def test_a_narrower_kv_cache_halves_kv_bytes_and_pages(model_dir, capsys):
    """A float32 base: fp16 KV pages hold each token in half the bytes, so a page is half as large
    and the same memory holds twice the pages."""
    argv = ("--model", str(model_dir), "--dtype", "float32", "--json")
    wide = json.loads(plan_text(capsys, *argv))["plan"]
    half = json.loads(plan_text(capsys, *argv, "--kv-cache-dtype", "fp16"))["plan"]
    assert half["kv_bytes_per_token"] * 2 == wide["kv_bytes_per_token"]
    assert half["pool_pages"] == pytest.approx(2 * wide["pool_pages"], abs=1)

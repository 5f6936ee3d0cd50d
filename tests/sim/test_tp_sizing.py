"""Tensor parallelism in the sizing arithmetic and the simulator.

Seed 003's worked example: Atlas, 140 GB in BF16 (hidden 8,192, 80 layers; its arithmetic treats
every projection as an 8,192 x 8,192 matrix), 50 rank-16 adapters on q, k, v, o of 4 x 80 layers x
2 matrices x 8,192 x 16 x 2 bytes = 160 MiB each, on 4-way tensor parallelism over 80 GB devices:
each device holds 35 GB of base weights and 2 GB of adapter weights, "leaving about 43 GB for KV
cache, activations, and graph pools" (45 GB without adapters); on all seven projections each
adapter "doubles" to about 320 MiB, 4 GB per device, and KV drops from 45 to 41 GB.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lorapage.capacity.cli import main
from lorapage.replay.generator import GenConfig, generate
from lorapage.sim.costs import GPU_7B, StepShape
from lorapage.sim.fleet import SimFleetConfig, simulate
from lorapage.sim.loader import ResidencyConfig
from lorapage.sim.simulator import SimConfig
from lorapage.sim.tensor_parallel import (
    NVLINK,
    SEED_7B_SHAPE,
    ModelShape,
    tensor_parallel_costs,
    tensor_parallel_fleet,
)

HIDDEN, LAYERS, RANK, ADAPTERS, TP, BASE_GB, DEVICE_GB = 8192, 80, 16, 50, 4, 140, 80
ATLAS = {  # as seed 003's arithmetic sees it: every projection [hidden, hidden]
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": HIDDEN,
    "intermediate_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "vocab_size": 32000,
}
GB = 1e9


@pytest.fixture(scope="module")
def atlas(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("atlas")
    (path / "config.json").write_text(json.dumps(ATLAS))
    return path


def plan_json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["plan"]


def seed_003(capsys, atlas: Path, modules: str, *more: str) -> dict:
    return plan_json(
        capsys, "--model", str(atlas), "--base-gb", str(BASE_GB), "--device-gb", str(DEVICE_GB),
        "--working-gb", "0", "--rank", str(RANK), "--modules", modules, "--adapters", str(ADAPTERS),
        "--resident-adapters", str(ADAPTERS), "--tensor-parallel-size", str(TP), *more,
    )  # fmt: skip


def test_seed_003_atlas_on_four_devices(atlas, capsys):
    plan = seed_003(capsys, atlas, "attention")
    per_adapter = 4 * LAYERS * 2 * HIDDEN * RANK * 2  # the seed's own product
    assert plan["adapter_bytes"] == per_adapter == 160 * 2**20
    assert plan["tensor_parallel_size"] == TP
    assert plan["device_base_bytes"] == BASE_GB * GB / TP and round(plan["device_base_bytes"] / GB) == 35
    assert plan["device_adapter_bytes"] == per_adapter / TP  # a quarter of each adapter per device
    assert plan["device_adapters_bytes"] == ADAPTERS * per_adapter / TP
    assert round(plan["device_adapters_bytes"] / GB) == 2
    assert plan["kv_left_bytes"] == DEVICE_GB * GB - BASE_GB * GB / TP - ADAPTERS * per_adapter / TP
    assert round(plan["kv_left_bytes"] / GB) == 43 and round(plan["kv_left_no_adapters_bytes"] / GB) == 45
    # KV tokens per device: each device holds its quarter of every token's K and V (16 of 64 heads).
    per_token_device = 2 * LAYERS * HIDDEN * 2 / TP
    assert plan["device_kv_bytes_per_token"] == per_token_device
    assert plan["kv_tokens"] == int(plan["kv_left_bytes"] // per_token_device)
    # The seed: adapters are ~4.5% of the adapter-free KV budget (2 of 45 GB, 4.4%; 2.1 of 45, 4.7%).
    assert 0.04 < plan["device_adapters_bytes"] / plan["kv_left_no_adapters_bytes"] < 0.05


def test_seed_003_with_mlp_adapters(atlas, capsys):
    """All seven projections (the seed's "doubles to about 320 MiB": 7 x 512 KiB x 80 = 280 MiB on
    its square matrices): about 4 GB of adapters per device and KV from 45 down to 41 GB."""
    plan = seed_003(capsys, atlas, "all")
    assert plan["adapter_bytes"] == 7 * LAYERS * 2 * HIDDEN * RANK * 2
    assert round(plan["device_adapters_bytes"] / GB) == 4 and round(plan["kv_left_bytes"] / GB) == 41


def test_the_text_names_the_per_device_figures(atlas, capsys):
    assert main(["--model", str(atlas), "--base-gb", "140", "--working-gb", "0", "--modules", "attention",
                 "--adapters", "50", "--tensor-parallel-size", "4"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "one 80.0 GB device of 4" in text
    assert "35.0 GB = 140 GB / 4" in text
    assert "50 x 41.9 MB (1/4 of 168 MB) = 2.10 GB" in text  # 50 resident by default: all fit
    assert "left for KV               42.9 GB" in text
    assert text.split("  total", 1)[1].splitlines()[0].endswith(" devices")


def test_tp_grows_the_pool_per_device_and_refuses_unequal_shares(atlas, capsys, tmp_path):
    small = ("--model", str(atlas), "--base-gb", "40", "--max-num-seqs", "4", "--max-model-len", "1000")
    one = plan_json(capsys, *small)
    four = plan_json(capsys, *small, "--tensor-parallel-size", "4")
    assert one["pool_adapters"] > 0
    # A device's pages are a quarter as wide and the base's share frees room: more than 4x the pages.
    assert four["page_bytes"] * 4 == one["page_bytes"]
    assert four["pool_pages"] > 4 * one["pool_pages"]
    assert four["adapter_pages"] == one["adapter_pages"] and four["pool_adapters"] > 4 * one["pool_adapters"]
    # Its step: the cost model at 4 devices (decode faster than one device, not 4x: the all-reduces).
    assert one["step_s"] / 4 < four["step_s"] < one["step_s"]
    with pytest.raises(SystemExit):
        main(["--model", str(atlas), "--tensor-parallel-size", "3"])
    assert "must divide the model's num_attention_heads (64)" in capsys.readouterr().err


def test_the_cost_model_at_k_devices():
    """compute / k plus 2 all-reduces per layer, each latency + 2 (k-1)/k x tokens x hidden x bytes / bus bw."""
    assert tensor_parallel_costs(GPU_7B, 1) is GPU_7B
    shape = StepShape(prefill_tokens=500, decode_rows=31, adapter_ranks=[16, 16, 8], copy_s=0.004)
    tokens, layers, hidden, elem = 531, SEED_7B_SHAPE.layers, SEED_7B_SHAPE.hidden, SEED_7B_SHAPE.elem_bytes
    for k in (2, 4, 8):
        tp = tensor_parallel_costs(GPU_7B, k)
        reduce_s = NVLINK.latency_s + 2 * (k - 1) / k * tokens * hidden * elem / NVLINK.bus_bytes_per_s
        expected = (GPU_7B.time(replace(shape, copy_s=0.0))) / k + 2 * layers * reduce_s + shape.copy_s
        assert tp.time(shape) == pytest.approx(expected, rel=1e-12)
        assert tp.loads.copy_s == GPU_7B.loads.copy_s / k and tp.loads.disk_s == GPU_7B.loads.disk_s
    # What the collectives cost grows with k; the compute they buy shrinks: k = 8 gains less than 8x.
    decode = StepShape(0, 32, [16] * 32)
    t1, t8 = GPU_7B.time(decode), tensor_parallel_costs(GPU_7B, 8).time(decode)
    assert t1 / 8 < t8 < t1
    wide = tensor_parallel_costs(GPU_7B, 2, ModelShape(layers=80, hidden=8192, elem_bytes=2))
    assert wide.collective_step_s == 160 * NVLINK.latency_s


def test_a_tp_fleet_in_the_simulator():
    """Each replica on 2 devices: twice the KV pages and lora slots, steps as the model; at the same
    replicas the fleet answers sooner (the requests' steps are shorter)."""
    base = SimFleetConfig(
        replicas=2,
        engine=SimConfig(max_num_seqs=16, max_num_batched_tokens=4096, num_kv_pages=512),
        residency=ResidencyConfig(max_resident_loras=8, max_cpu_loras=16, max_disk_loras=64),
    )
    tp = tensor_parallel_fleet(base, 2)
    assert tp.engine.num_kv_pages == 1024 and tp.residency.max_resident_loras == 16
    assert tp.costs.name == "gpu-7b-tp2" and tp.replicas == 2
    assert tensor_parallel_fleet(base, 2, scale_slots=False).residency.max_resident_loras == 8
    trace = generate(GenConfig(seed=1, rate=8.0, duration_s=10.0, adapters=40, prompt_mean=300, output_mean=40))
    p50 = {name: simulate(trace, cfg).summary()["ttft"]["all"]["p50"] for name, cfg in (("one", base), ("tp", tp))}
    assert p50["tp"] < p50["one"]


def test_replay_simulate_takes_the_flag():
    from argparse import Namespace

    from lorapage.sim.cli import fleet_config

    args = Namespace(replicas=3, seed=0, warmup=0.0, max_disk_loras=100)
    one = fleet_config(args, [])
    two = fleet_config(args, ["--tensor-parallel-size", "2"])
    assert two.costs.name == f"{one.costs.name}-tp2" and two.engine.num_kv_pages == 2 * one.engine.num_kv_pages
    assert two.residency.max_resident_loras == 2 * one.residency.max_resident_loras
    told = fleet_config(args, ["--tensor-parallel-size", "2", "--max-resident-loras", "40"])
    assert told.residency.max_resident_loras == 40  # the operator's slots are kept

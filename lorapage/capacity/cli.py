"""``lorapage plan``: the design's sizing arithmetic for a model, an adapter shape and a workload.

Prints, for one replica of this hardware: the adapter's values and bytes and its projected cost
(and serving tier), every adapter and every merged copy, the GPU memory left for adapters and
what lorapage's page pool holds, replicas for decode and prefill with headroom, host RAM for the
adapters each replica owns, and the resident set by Little's law (cache >= 2x). The workload is a
trace (``--trace``, as ``lorapage replay`` writes) or a rate and a Zipf over adapters.
``--find-replicas N`` also runs the fleet simulator (``lorapage replay run --simulate``) over the
trace (or one generated from the rate and Zipf) to find the fewest replicas meeting the SLO.

    lorapage plan --model DIR --rate 40 --adapters 5000 --zipf 1.3
    lorapage plan --model DIR --trace trace.jsonl --find-replicas 40

The defaults are seed 001's 7B replica (docs/capacity.md walks it): 16-bit weights, rank 16 on
every module, 80 GB devices with 4 GB of working memory, 32 sequences of up to 2,000 tokens,
2 owners per adapter, 30% headroom, the ``gpu-7b`` step costs. ``--tensor-parallel-size K``
prices a replica of K devices as seed 003 prices its 70B (docs/parallel.md):

    lorapage plan --model atlas --base-gb 140 --tensor-parallel-size 4 --modules attention --adapters 50
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from lorapage.adapters.cost import uniform_ranks
from lorapage.adapters.envelope import MODULE_CLASSES, Envelope
from lorapage.capacity.plan import Plan, Replica, Workload, make_plan
from lorapage.capacity.report import as_json, render
from lorapage.config import DTYPE_NAMES, FLEET_ENVELOPE, KV_CACHE_DTYPES, LORA_DTYPE_NAMES, EngineConfig
from lorapage.flags import add_config_flags, config_overrides, fail, parser
from lorapage.model.config import MODULES, ModelConfig
from lorapage.replay.generator import GenConfig, generate
from lorapage.replay.population import zipf_weights
from lorapage.sim.costs import COSTS, StepCosts
from lorapage.sim.fleet import SEED_SLO, SimFleetConfig, adapter_of
from lorapage.sim.loader import ResidencyConfig
from lorapage.sim.simulator import SimConfig
from lorapage.sim.tensor_parallel import ModelShape, tensor_parallel_costs
from lorapage.traces.trace import TraceError, TraceRequest, read_trace

PROG = "lorapage plan"
# int8 adapters' per-row scales (4 bytes per rank row of each matrix, under 1% of a rank-16
# adapter of a 768-wide model) are left out.
ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
_ENVELOPE_FIELDS = ("cost_reference_batch", "shared_envelope", "shared_max_cost_pct")
_FLAG_FIELDS = (*_ENVELOPE_FIELDS, "tensor_parallel_size")


def build_parser() -> argparse.ArgumentParser:
    p = parser(PROG, __doc__)
    p.add_argument(
        "--model", required=True, help="a Hugging Face model directory (or its config.json): only the shape is read"
    )
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="the weights' dtype on the device")
    p.add_argument("--lora-dtype", choices=LORA_DTYPE_NAMES, default="auto", help="the adapters' (auto: --dtype)")
    p.add_argument(
        "--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto", help="the KV pages' (auto: --dtype)"
    )
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    p.add_argument(
        "--modules", default="all", help="attention, mlp, all, or a comma-separated list of the projections adapted"
    )
    work = p.add_argument_group("workload: a trace, or a rate and a Zipf")
    work.add_argument("--trace", help="a trace JSONL (lorapage replay gen / import): rate, lengths, popularity")
    work.add_argument("--rate", type=float, default=None, help="requests/s (default 40, or the trace's)")
    work.add_argument("--adapters", type=int, default=None, help="registered adapters (default 5,000, or the trace's)")
    work.add_argument("--zipf", type=float, default=1.3, help="Zipf exponent of adapter popularity")
    work.add_argument("--prompt-mean", type=float, default=None, help="mean prompt tokens (default 750)")
    work.add_argument("--output-mean", type=float, default=None, help="mean output tokens (default 250)")
    work.add_argument("--base-name", default="base", help="the base model's name in the trace")
    rep = p.add_argument_group("one replica")
    rep.add_argument("--device-gb", type=float, default=80.0, help="device memory, GB (1e9 bytes)")
    rep.add_argument(
        "--base-gb", type=float, default=None, help="the base's weights on the device, GB (default: parameters x dtype)"
    )
    rep.add_argument("--working-gb", type=float, default=4.0, help="device memory for activations and workspaces")
    rep.add_argument("--host-gb", type=float, default=None, help="host RAM for adapters (default: show the need)")
    rep.add_argument("--max-num-seqs", type=int, default=32, help="sequences running at once")
    rep.add_argument("--max-model-len", type=int, default=2000, help="tokens per sequence the KV cache holds")
    rep.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    rep.add_argument("--owners", type=int, default=2, help="replicas each adapter is placed on")
    rep.add_argument("--headroom", type=float, default=0.3, help="replicas beyond the arithmetic's, as a fraction")
    rep.add_argument("--costs", choices=sorted(COSTS), default="gpu-7b", help="the step-time model")
    rep.add_argument(
        "--resident-adapters",
        type=int,
        default=None,
        help="adapters resident on every device, priced first as seed 003 does (KV gets the rest; "
        "default: the registered ones, up to what fits beside every sequence's KV)",
    )
    sim = p.add_argument_group("the fleet simulator")
    sim.add_argument(
        "--find-replicas", type=int, default=0, help="also find the fewest replicas (up to N) meeting the SLO"
    )
    sim.add_argument("--duration", type=float, default=90.0, help="seconds of generated trace to simulate")
    sim.add_argument("--warmup", type=float, default=30.0, help="seconds of trace run but left out of the figures")
    sim.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    add_config_flags(p, EngineConfig, only=_FLAG_FIELDS)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object instead")
    return p


def load_model(path: str) -> ModelConfig:
    target = Path(path)
    try:
        return ModelConfig.from_dir(target.parent if target.name == "config.json" else target)
    except (OSError, ValueError) as exc:
        fail(PROG, f"--model {path}: {exc}")


def check_shares(model: ModelConfig, k: int) -> None:
    """ValueError unless ``k`` devices take equal shares of the heads, KV heads and MLP columns
    (what the engine asks too, ``lorapage.parallel.check_tensor_parallel``)."""
    for name, value in (
        ("num_attention_heads", model.num_heads),
        ("num_key_value_heads", model.num_kv_heads),
        ("intermediate_size", model.intermediate_size),
    ):
        if value % k:
            raise ValueError(f"--tensor-parallel-size {k} must divide the model's {name} ({value})")


def modules_of(text: str) -> tuple[str, ...]:
    if text in MODULE_CLASSES:
        return MODULE_CLASSES[text]
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if not names or any(m not in MODULES for m in names):
        fail(PROG, f"--modules {text!r}: give attention, mlp, all, or some of {', '.join(MODULES)}")
    return tuple(m for m in MODULES if m in names)


def trace_workload(trace: list[TraceRequest], args: argparse.Namespace) -> Workload:
    """Rate, mean lengths and popularity as the trace has them (flags given override)."""
    if len(trace) < 2 or trace[-1].arrival_s <= trace[0].arrival_s:
        fail(PROG, f"--trace {args.trace}: needs at least two requests over a span of time")
    arrivals = sorted(r.arrival_s for r in trace)
    adapters = Counter(a for r in trace if (a := adapter_of(r.model, args.base_name)) is not None)
    prompts = [r.prompt_len or len(r.prompt_ids or ()) or len(r.prompt or "") for r in trace]
    return Workload(
        rate=args.rate or len(trace) / (arrivals[-1] - arrivals[0]),
        prompt_mean=args.prompt_mean or sum(prompts) / len(trace),
        output_mean=args.output_mean or sum(r.max_tokens for r in trace) / len(trace),
        adapters=max(args.adapters or 0, len(adapters)),
        popularity=[n / len(trace) for n in adapters.values()],
    )


def zipf_workload(args: argparse.Namespace) -> Workload:
    adapters = 5000 if args.adapters is None else args.adapters
    if adapters < 1 or args.zipf < 0:
        fail(PROG, "--adapters must be >= 1 and --zipf >= 0")
    return Workload(
        rate=40.0 if args.rate is None else args.rate,
        prompt_mean=args.prompt_mean or 750.0,
        output_mean=args.output_mean or 250.0,
        adapters=adapters,
        popularity=list(zipf_weights(adapters, args.zipf)),
    )


def simulate(
    plan: Plan, replica: Replica, args: argparse.Namespace, trace: list[TraceRequest], rank: int, costs: StepCosts
) -> dict:
    """The affinity-routed fleet at the plan's replicas, and the fewest meeting the seed's SLO."""
    from lorapage.sim.compare import compare_routers

    config = SimFleetConfig(
        replicas=plan.replicas,
        router_options={"owners": replica.owners},
        engine=SimConfig(
            max_num_seqs=replica.max_num_seqs,
            max_num_batched_tokens=8192,
            num_kv_pages=SimConfig.num_kv_pages * replica.tensor_parallel_size,  # pages 1/k as wide
        ),
        residency=ResidencyConfig(
            max_resident_loras=max(1, plan.pool_adapters),
            max_cpu_loras=max(1, plan.host_adapters or round(plan.adapters_per_replica)),
            max_disk_loras=1000,
            rank=rank,
        ),
        costs=costs,
        warmup_s=args.warmup,
        base_name=args.base_name,
    )
    (row,) = compare_routers(trace, config, ["affinity"], find_most=args.find_replicas, slo=SEED_SLO)
    return row


def sim_lines(row: dict, requests: int, source: str) -> list[str]:
    warm, cold = row["ttft"]["warm"]["p95"], row["ttft"]["cold"]["p95"]
    fewest = row["fewest_replicas"]
    return [
        f"simulator ({source}, {requests:,} requests, affinity routing)",
        f"  {'at ' + str(row['replicas']) + ' replicas':<26}p95 TTFT {_s(warm)} warm, {_s(cold)} cold: "
        f"{'meets' if row['meets_slo'] else 'misses'} < {SEED_SLO.ttft_s:g} s / < {SEED_SLO.ttft_cold_s:g} s",
        f"  {'fewest meeting the SLO':<26}{fewest if fewest is not None else 'none up to the bound'}",
    ]


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    model = load_model(args.model)
    modules = modules_of(args.modules)
    lora_dtype = args.dtype if args.lora_dtype == "auto" else args.lora_dtype
    if args.rank < 1:
        fail(PROG, f"--rank must be >= 1; got {args.rank}")
    if args.resident_adapters is not None and args.resident_adapters < 0:
        fail(PROG, f"--resident-adapters must be >= 0; got {args.resident_adapters}")
    try:
        # A fleet has a dedicated tier: its envelope, unless given, is the narrow one.
        config = EngineConfig(**{"shared_envelope": FLEET_ENVELOPE, **config_overrides(args, _FLAG_FIELDS)})
        check_shares(model, config.tensor_parallel_size)
        replica = Replica(
            device_bytes=args.device_gb * 1e9,
            working_bytes=args.working_gb * 1e9,
            base_bytes=None if args.base_gb is None else args.base_gb * 1e9,
            host_bytes=None if args.host_gb is None else args.host_gb * 1e9,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            owners=args.owners,
            headroom=args.headroom,
            tensor_parallel_size=config.tensor_parallel_size,
            resident_adapters=args.resident_adapters,
        )
        trace = read_trace(args.trace) if args.trace else None
    except (OSError, ValueError, TraceError) as exc:
        fail(PROG, str(exc))
    workload = trace_workload(trace, args) if trace is not None else zipf_workload(args)
    envelope = Envelope.from_config(config, model, ELEM_BYTES[args.dtype], ELEM_BYTES[lora_dtype])
    ranks = uniform_ranks(model, args.rank, modules)
    costs = tensor_parallel_costs(
        COSTS[args.costs],
        config.tensor_parallel_size,
        ModelShape(model.num_layers, model.hidden_size, ELEM_BYTES[args.dtype]),
    )
    plan = make_plan(
        model,
        ranks,
        base_elem=ELEM_BYTES[args.dtype],
        adapter_elem=ELEM_BYTES[lora_dtype],
        kv_elem=ELEM_BYTES[KV_CACHE_DTYPES[args.kv_cache_dtype] or args.dtype],
        envelope=envelope,
        workload=workload,
        replica=replica,
        costs=costs,
    )
    source = f"trace {args.trace}" if args.trace else f"Zipf {args.zipf:g}"
    sim_row = None
    if args.find_replicas:
        sim_trace = trace if trace is not None else generated_trace(args, workload)
        sim_row = simulate(plan, replica, args, sim_trace, args.rank, costs)
    if args.json:
        print(json.dumps({"plan": as_json(plan), "simulation": sim_row}, default=float))
        return 0
    name = Path(args.model).resolve().name if Path(args.model).is_dir() else Path(args.model).resolve().parent.name
    lines = render(
        plan, model, name=name, dtype=args.dtype, rank=args.rank, modules=modules, workload=workload,
        replica=replica, costs=args.costs, source=source,
    )  # fmt: skip
    if sim_row is not None:
        what = args.trace if trace is not None else f"{args.duration:g} s generated, warm-up {args.warmup:g} s"
        lines += sim_lines(sim_row, sim_row["requests"], what)
    print("\n".join(lines))
    return 0


def generated_trace(args: argparse.Namespace, workload: Workload) -> list[TraceRequest]:
    """The seed workload's shape at this rate, Zipf and mean lengths (``lorapage replay gen``'s)."""
    gen = replace(
        GenConfig(),
        seed=args.seed,
        rate=workload.rate,
        duration_s=args.duration,
        adapters=workload.adapters,
        zipf_alpha=args.zipf,
        prompt_mean=workload.prompt_mean,
        output_mean=workload.output_mean,
    )
    return generate(gen)

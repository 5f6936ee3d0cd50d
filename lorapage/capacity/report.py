"""A :class:`~lorapage.capacity.plan.Plan` as the lines ``lorapage plan`` prints, and as JSON."""

from __future__ import annotations

import dataclasses

from lorapage.adapters.envelope import format_bytes
from lorapage.capacity.plan import Plan, Replica, Workload
from lorapage.model.config import ModelConfig

W = 26  # width of the label column


def _row(label: str, text: str) -> str:
    return f"  {label:<{W}}{text}"


def render(
    plan: Plan,
    model: ModelConfig,
    *,
    name: str,
    dtype: str,
    rank: int,
    modules: tuple[str, ...],
    workload: Workload,
    replica: Replica,
    costs: str,
    source: str,
) -> list[str]:
    """The plan as readable lines, section by section in the order the design derives them."""
    p, c = plan, plan.cost
    pct = 100 * sum(workload.popularity)
    lines = [
        f"lorapage plan: {name} ({model.num_layers} layers, hidden {model.hidden_size:,}, KV {model.kv_size:,}, "
        f"MLP {model.intermediate_size:,}, vocab {model.vocab_size:,}), {dtype} weights",
        f"workload: {source}: {workload.rate:g} requests/s, prompts {workload.prompt_mean:,.0f} and outputs "
        f"{workload.output_mean:,.0f} tokens on average, {workload.adapters:,} adapters ({pct:.0f}% of requests)",
        "",
        f"adapter: rank {rank} on {', '.join(modules)}",
        _row("per layer", f"{p.values_per_layer:,} values (r x (d_in + d_out) per module)"),
        _row("whole adapter", f"{p.adapter_values:,} values = {format_bytes(p.adapter_bytes)}"),
        _row(
            "projected cost",
            f"+{c.projected_cost_pct:.1f}% decode bytes at batch {c.reference_batch}, each row on its own adapter "
            f"(+{c.flops_pct:.2f}% FLOPs per token): tier {p.tier.value}",
        ),
        _row(
            f"all {workload.adapters:,} adapters",
            f"{format_bytes(p.all_adapters_bytes)}; merged copies {workload.adapters:,} x "
            f"{format_bytes(p.base_bytes)} = {format_bytes(p.merged_bytes)}",
        ),
        *_gpu_head(p, replica),
        _row(
            "KV cache",
            f"{format_bytes(p.kv_bytes)} = {_per_token(p)} bytes per token x {replica.max_num_seqs} "
            f"sequences x {replica.max_model_len:,} tokens",
        ),
        _row("working memory", format_bytes(replica.working_bytes)),
        _row("left for adapters", f"{format_bytes(p.left_bytes)} = {p.adapters_fit:,} adapters"),
        _row(
            "as lorapage's pool",
            f"{p.pool_pages:,} pages of {format_bytes(p.page_bytes)} ({replica.block_size} tokens of KV): "
            f"{p.kv_pages:,} for KV, {p.pool_adapters:,} adapters of {p.adapter_pages} pages",
        ),
        *(_seed_003(p, replica) if p.tensor_parallel_size > 1 or replica.resident_adapters is not None else []),
        f"replicas ({costs} step costs{_tp_costs(p, model)})",
        _row(
            "decode",
            f"{p.decode_tokens_s:,.0f} tokens/s / {p.replica_decode_tokens_s:,.0f} per replica "
            f"({replica.max_num_seqs} rows / {1e3 * p.step_s:.1f} ms per step) = "
            f"{p.decode_tokens_s / p.replica_decode_tokens_s:.1f}",
        ),
        _row(
            "prefill",
            f"{p.prefill_tokens_s:,.0f} tokens/s / {p.replica_prefill_tokens_s:,.0f} per replica = "
            f"{p.prefill_tokens_s / p.replica_prefill_tokens_s:.2f}",
        ),
        _row(
            "total",
            f"{p.replicas_exact:.1f} -> {p.replicas} replicas with {100 * replica.headroom:.0f}% headroom"
            + (f" = {p.replicas * p.tensor_parallel_size} devices" if p.tensor_parallel_size > 1 else ""),
        ),
        "host RAM",
        _row(
            "placement",
            f"{min(replica.owners, p.replicas)} owners x {workload.adapters:,} adapters / {p.replicas} replicas = "
            f"{p.adapters_per_replica:,.0f} adapters per replica = {format_bytes(p.host_bytes_per_replica)}",
        ),
    ]
    if p.host_adapters is not None:
        assert replica.host_bytes is not None
        verdict = "holds" if p.host_adapters >= p.adapters_per_replica else "does NOT hold"
        lines.append(
            _row("host budget", f"{format_bytes(replica.host_bytes)} = {p.host_adapters:,} adapters: {verdict} them")
        )
    fits = "fits" if p.cache_fits else "does NOT fit"
    lines += [
        "resident adapters (Little's law)",
        _row(
            "request duration",
            f"{p.duration_s:.2f} s = {workload.prompt_mean:,.0f} prompt tokens / {p.replica_prefill_tokens_s:,.0f} "
            f"per s + {workload.output_mean:,.0f} tokens x {1e3 * p.step_s:.1f} ms",
        ),
        _row(
            "in flight",
            f"{p.in_flight:,.0f} requests = {workload.rate:g}/s x {p.duration_s:.2f} s; "
            f"{p.in_flight_per_replica:.1f} per replica (of {replica.max_num_seqs} rows)",
        ),
        _row(
            "distinct adapters",
            f"{p.distinct_in_flight:,.0f} in flight fleet-wide = sum of 1 - exp(-rate x share x duration); "
            f"{p.resident_per_replica:,.1f} per replica ({min(replica.owners, p.replicas)} owners each, more for "
            "adapters busier than that)",
        ),
        _row(
            "cache >= 2x",
            f"{p.cache_adapters:,.0f} adapters = {format_bytes(p.cache_adapters * p.adapter_bytes)}: "
            f"{fits} in the {p.pool_adapters:,} the pool holds",
        ),
    ]
    return lines


def _gpu_head(p: Plan, replica: Replica) -> list[str]:
    """The section's title and its base row: one device's share under tensor parallelism."""
    k = p.tensor_parallel_size
    given = "as given; " if replica.base_bytes is not None else ""
    if k == 1:
        return [
            f"GPU memory: one {format_bytes(replica.device_bytes)} device",
            _row("base weights", f"{format_bytes(p.base_bytes)} ({given}{p.base_params:,} parameters)"),
        ]
    return [
        f"GPU memory: one {format_bytes(replica.device_bytes)} device of {k} (tensor parallel: each holds 1/{k} "
        "of the base, of every adapter and of every token's KV)",
        _row(
            "base weights",
            f"{format_bytes(p.device_base_bytes)} = {format_bytes(p.base_bytes)} / {k} "
            f"({given}{p.base_params:,} parameters)",
        ),
    ]


def _per_token(p: Plan) -> str:
    if p.tensor_parallel_size == 1:
        return f"{p.kv_bytes_per_token:,}"
    return f"{p.device_kv_bytes_per_token:,.0f} (= {p.kv_bytes_per_token:,} / {p.tensor_parallel_size})"


def _seed_003(p: Plan, replica: Replica) -> list[str]:
    """Seed 003's accounting on one device: the base's share and the resident adapters' shards
    first, what is left for KV (activations and graph pools are ``--working-gb``), its tokens."""
    k = p.tensor_parallel_size
    shard = f" (1/{k} of {format_bytes(p.adapter_bytes)})" if k > 1 else ""
    return [
        f"per device, adapters first (seed 003's accounting): {p.resident_adapters:,} resident adapters",
        _row(
            "adapters resident",
            f"{p.resident_adapters:,} x {format_bytes(p.device_adapter_bytes)}{shard} = "
            f"{format_bytes(p.device_adapters_bytes)}",
        ),
        _row(
            "left for KV",
            f"{format_bytes(p.kv_left_bytes)} = {format_bytes(replica.device_bytes)} - "
            f"{format_bytes(p.device_base_bytes)} base - {format_bytes(p.device_adapters_bytes)} adapters - "
            f"{format_bytes(replica.working_bytes)} working ({format_bytes(p.kv_left_no_adapters_bytes)} "
            "without adapters)",
        ),
        _row(
            "KV tokens",
            f"{p.kv_tokens:,} at {p.device_kv_bytes_per_token:,.0f} bytes per token per device = "
            f"{p.kv_tokens / replica.max_model_len:,.1f} sequences of {replica.max_model_len:,} tokens",
        ),
    ]


def _tp_costs(p: Plan, model: ModelConfig) -> str:
    k = p.tensor_parallel_size
    if k == 1:
        return ""
    return f" on {k} devices: compute / {k} + {2 * model.num_layers} all-reduces per step"


def as_json(plan: Plan) -> dict:
    """Every figure of the plan, JSON-ready."""
    out = dataclasses.asdict(plan)
    out["tier"] = plan.tier.value
    out["cost"] = dataclasses.asdict(plan.cost) | {
        "projected_cost_pct": plan.cost.projected_cost_pct,
        "flops_pct": plan.cost.flops_pct,
    }
    return out

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
        f"GPU memory: one {format_bytes(replica.device_bytes)} device",
        _row(
            "base weights",
            f"{format_bytes(p.base_bytes)} ({p.base_params:,} parameters)"
            if replica.base_bytes is None
            else f"{format_bytes(p.base_bytes)} (as given; {p.base_params:,} parameters)",
        ),
        _row(
            "KV cache",
            f"{format_bytes(p.kv_bytes)} = {p.kv_bytes_per_token:,} bytes per token x {replica.max_num_seqs} "
            f"sequences x {replica.max_model_len:,} tokens",
        ),
        _row("working memory", format_bytes(replica.working_bytes)),
        _row("left for adapters", f"{format_bytes(p.left_bytes)} = {p.adapters_fit:,} adapters"),
        _row(
            "as lorapage's pool",
            f"{p.pool_pages:,} pages of {format_bytes(p.page_bytes)} ({replica.block_size} tokens of KV): "
            f"{p.kv_pages:,} for KV, {p.pool_adapters:,} adapters of {p.adapter_pages} pages",
        ),
        f"replicas ({costs} step costs)",
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
        _row("total", f"{p.replicas_exact:.1f} -> {p.replicas} replicas with {100 * replica.headroom:.0f}% headroom"),
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


def as_json(plan: Plan) -> dict:
    """Every figure of the plan, JSON-ready."""
    out = dataclasses.asdict(plan)
    out["tier"] = plan.tier.value
    out["cost"] = dataclasses.asdict(plan.cost) | {
        "projected_cost_pct": plan.cost.projected_cost_pct,
        "flops_pct": plan.cost.flops_pct,
    }
    return out

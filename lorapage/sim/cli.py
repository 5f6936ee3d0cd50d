"""``lorapage replay run --simulate``: the fleet simulator from the replay command line.

Each replica is sized by the same engine flags ``lorapage serve`` takes (only the ones the
simulator models: ``--max-loras``, ``--max-resident-loras``, ``--max-cpu-loras``,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--scheduler``, ``--reserved-tail-lanes``,
``--lane-age-deadline-s``, ``--tensor-parallel-size``); absent ones take the seed design's 7B
replica (250 resident, at most 32 distinct adapters in one batch). ``--tensor-parallel-size K``
puts each replica on K devices (:mod:`lorapage.sim.tensor_parallel`: step costs, pool per rank).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from lorapage.config import EngineConfig
from lorapage.flags import add_config_flags
from lorapage.fleet.routing import ROUTERS
from lorapage.sim.compare import compare_routers, render_table
from lorapage.sim.fleet import SimFleetConfig
from lorapage.sim.tensor_parallel import tensor_parallel_fleet
from lorapage.traces.stats import Slo
from lorapage.traces.trace import TraceRequest

PROG = "lorapage replay run --simulate"
_SIM_FIELDS = (
    "max_loras",
    "max_resident_loras",
    "max_cpu_loras",
    "max_num_seqs",
    "max_num_batched_tokens",
    "scheduler",
    "reserved_tail_lanes",
    "lane_age_deadline_s",
    "lane_lend_max_tokens",
    "tensor_parallel_size",
)
# Engine flags -> the simulator's VtcConfig fields.
_VTC_FIELDS = {
    "max_loras": "max_loras",
    "reserved_tail_lanes": "reserved_tail_lanes",
    "lane_age_deadline_s": "age_deadline_s",
    "lane_lend_max_tokens": "lend_max_tokens",
}


def fleet_config(args: argparse.Namespace, rest: Sequence[str]) -> SimFleetConfig:
    """The fleet ``args`` (replay's flags) and ``rest`` (engine flags) describe."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False)
    add_config_flags(parser, EngineConfig, only=_SIM_FIELDS)
    engine_args, leftover = parser.parse_known_args(list(rest))
    given = {n: getattr(engine_args, n) for n in _SIM_FIELDS if getattr(engine_args, n, None) is not None}
    unused = [a for a in rest if a.startswith("--") and a[2:].replace("-", "_").split("=")[0] not in _SIM_FIELDS]
    if leftover or unused:
        raise SystemExit(
            f"{PROG}: the simulator models only --{', --'.join(f.replace('_', '-') for f in _SIM_FIELDS)}; "
            f"got {' '.join(leftover or unused)}"
        )
    base = SimFleetConfig()
    engine = replace(base.engine, **{k: v for k, v in given.items() if k in ("max_num_seqs", "max_num_batched_tokens")})
    residency = replace(
        base.residency,
        max_disk_loras=args.max_disk_loras,
        **{k: v for k, v in given.items() if k in ("max_resident_loras", "max_cpu_loras")},
    )
    try:
        vtc = replace(base.vtc, **{_VTC_FIELDS[k]: v for k, v in given.items() if k in _VTC_FIELDS})
        fleet = replace(
            base,
            replicas=args.replicas,
            seed=args.seed,
            scheduler=given.get("scheduler", base.scheduler),
            vtc=vtc,
            engine=engine,
            residency=residency,
            warmup_s=args.warmup,
        )
        k = given.get("tensor_parallel_size", 1)
        return tensor_parallel_fleet(fleet, k, scale_slots="max_resident_loras" not in given)
    except ValueError as exc:
        raise SystemExit(f"{PROG}: {exc}") from None


def run_simulation(
    args: argparse.Namespace, trace: list[TraceRequest], rest: Sequence[str], slo: Slo, out: Path
) -> str:
    """Compare the routers of ``--router`` on ``trace``; writes ``out/fleet.json`` and
    ``out/fleet.md`` and returns the table."""
    routers = [r.strip() for r in args.router.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        raise SystemExit(f"{PROG}: --router takes a comma-separated list of {', '.join(ROUTERS)}; got {args.router!r}")
    config = fleet_config(args, rest)
    rows = compare_routers(trace, config, routers, find_most=args.find_replicas, slo=slo)
    table = render_table(rows, slo)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"trace": args.trace, "requests": len(trace), "costs": config.costs.name, "config": repr(config)}
    (out / "fleet.json").write_text(json.dumps({"meta": meta, "routers": rows}, indent=1, default=str) + "\n")
    (out / "fleet.md").write_text(f"# Fleet simulation: {args.trace}\n\n{table}\n")
    done = f"lorapage replay: simulated {len(trace)} requests on {config.replicas} replicas; report in {out}/fleet.md"
    return f"{table}\n\n{done}"

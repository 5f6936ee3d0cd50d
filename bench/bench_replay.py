"""Benchmarks through `lorapage replay` (the embedded engine, the ~100M bench model, CPU by default).

1. S-LoRA's headline: the same closed-loop trace (N requests, 32 in flight, adapters Zipf(1.0))
   with 5 and with 2,000 registered adapters (rank 16 on all seven projections). Target:
   throughput with 2,000 >= 0.95 x with 5 (medians of --rounds passes of each, taken in turn in
   alternating order).
   Reports TTFT p95 of both. The 2,000 adapters are 5 real
   PEFT directories each registered under 400 names: every name is a distinct adapter to the
   engine (its own registry entry, host-RAM copy, pool pages and slot), so loads, evictions and
   batching behave as with 2,000 directories without writing 20 GB.
2. Fairness under a flood: one tenant sends 20x the others' rate, past the engine's capacity
   (open loop, 8 rows); the three light tenants' p99 TTFT under FCFS and under VTC.
   Target: FCFS / VTC >= 2.
3. The seed workload (5,000 adapters, Zipf 1.3, 40 req/s) scaled to this CPU (x0.02: 100
   adapters, 0.8 req/s; prompts of 32 and outputs of 16 tokens, max_loras 16): p95 TTFT of
   requests whose adapter was resident (tier gpu) against those that had to load it (ram / disk).
   Targets: the seed's SLOs, 1 s warm and 2 s cold.

    python bench/bench_replay.py [--quick] [--only slora,fairness,seed] [--rounds 4] [--lora-dtype auto]
        [--seed-scale 0.02] [--out DIR]

Each benchmark prints a table; the last line is one JSON object with every figure and target.
Reports (report.md, plots) of every run are written under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
import time
from pathlib import Path

from harness import interleaved, machine_info, machine_line, median, print_json, table
from msgspec.structs import replace as with_fields
from workloads import SHORT, SLORA_ADAPTERS, SLORA_OPTIONS, engine_for, make_assets, run, slora_traces

from lorapage.config import LORA_DTYPE_NAMES
from lorapage.replay import GenConfig, RunOptions, generate
from lorapage.replay.engine_flags import trace_adapters
from lorapage.traces.stats import latency

VARIED = {**SHORT, "output_sigma": 0.5, "output_max": 40}


def p(report: dict, *path: str) -> float | None:
    node = report
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, (int, float)) else None


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def forward_cpu(engine) -> list[float]:
    """A one-element list holding the forward thread's CPU seconds over every step ``engine`` runs
    from now on (the runner's ``execute`` wrapped on the instance, timed by ``time.thread_time``)."""
    total = [0.0]
    runner = engine._runner
    execute = runner.execute

    def wrapped(plan):
        start = time.thread_time()
        try:
            return execute(plan)
        finally:
            total[0] += time.thread_time() - start

    runner.execute = wrapped
    return total


def process_cpu() -> float:
    """This process's CPU seconds so far, every thread's (the forward's, the I/O threads', the loop's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def bench_slora(
    model: Path, dirs: list[Path], out: Path, quick: bool, rounds: int = 4, lora_dtype: str = "auto"
) -> dict:
    n = 64 if quick else 192
    big = SLORA_ADAPTERS
    width = len(str(big - 1))
    trace_small, trace_big = slora_traces(n)
    opts = SLORA_OPTIONS
    # The two configurations run in turn, `rounds` times, each on a fresh engine; every figure is
    # the median of its rounds. One pass of each swings by +-15% with the shared cores' load, so
    # the order alternates (5 first, then 2,000 first, ...): a drift in the machine's load over
    # the run then falls on both alike instead of always on the one that runs second.
    samples: dict[int, list[dict]] = {5: [], big: []}
    configs = (("slora-5", trace_small, 5), ("slora-2000", trace_big, big))
    for i, (label, trace, registered) in interleaved(rounds, configs):
        names = [f"a{k:0{width}d}" for k in range(registered)]
        assert set(trace_adapters(trace, "base")) <= set(names)
        engine, reg_s = engine_for(model, dirs, names, lora_dtype=lora_dtype)
        forward, cpu0 = forward_cpu(engine), process_cpu()
        report = await run(engine, trace, opts, out, f"{label}-round{i + 1}")
        tokens = sum(r.max_tokens for r in trace)  # the same in both traces: the CPU ratio is per token
        samples[registered].append(
            {
                "register_s": reg_s,
                "tokens_per_s": p(report, "throughput", "output_tokens_per_s"),
                "requests_per_s": p(report, "throughput", "requests_per_s"),
                "ttft_p50": p(report, "latency", "overall", "ttft", "p50"),
                "ttft_p95": p(report, "latency", "overall", "ttft", "p95"),
                "ok": report["statuses"]["by_outcome"].get("ok", 0),
                # CPU per output token: the forward thread's, and the whole process's (loads included)
                "forward_cpu_ms_per_token": forward[0] / tokens * 1e3,
                "process_cpu_ms_per_token": (process_cpu() - cpu0) / tokens * 1e3,
            }
        )
    rows = {}
    for registered, runs in samples.items():
        rows[registered] = {key: median(r[key] or 0.0 for r in runs) for key in runs[0]}
        rows[registered] |= {"registered": registered, "distinct_in_trace": len({r.model for r in trace_big})}
    rows[5]["distinct_in_trace"] = 5
    small, large = rows[5], rows[big]
    ratio = large["tokens_per_s"] / small["tokens_per_s"]
    per_round = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(samples[5], samples[big])]
    print(
        f"\n1. S-LoRA headline: {n} requests, 32 in flight, Zipf(1.0) adapters, rank 16 all modules, lora_dtype {lora_dtype}"
    )
    print(f"medians of {rounds} rounds, the two configurations in turn, in alternating order")
    header = ["registered", "distinct in trace", "register (s)", "output tokens/s", "requests/s"]
    header += ["TTFT p50 (ms)", "TTFT p95 (ms)", "ok"]
    cells = [
        [f"{r['registered']:,}", r["distinct_in_trace"], f"{r['register_s']:.1f}", f"{r['tokens_per_s']:.1f}"]
        + [f"{r['requests_per_s']:.2f}", ms(r["ttft_p50"]), ms(r["ttft_p95"]), f"{r['ok']:.0f}"]
        for r in (small, large)
    ]
    print(table(header, cells, "rrrrrrrr"))
    rounds_text = ", ".join(f"{x:.2f}" for x in per_round)
    print(f"throughput 2,000 / 5: {ratio:.3f} (target >= 0.95); per round: {rounds_text}")
    fwd = small["forward_cpu_ms_per_token"] / large["forward_cpu_ms_per_token"]
    proc = small["process_cpu_ms_per_token"] / large["process_cpu_ms_per_token"]
    print(
        f"CPU per output token, 5 / 2,000 (what the ratio would be were CPU time the only cost): forward "
        f"thread {fwd:.3f} ({small['forward_cpu_ms_per_token']:.2f} / {large['forward_cpu_ms_per_token']:.2f} ms), "
        f"whole process {proc:.3f} ({small['process_cpu_ms_per_token']:.2f} / "
        f"{large['process_cpu_ms_per_token']:.2f} ms)"
    )
    return {
        "slora_requests": n,
        "slora_lora_dtype": lora_dtype,
        "slora_rounds": rounds,
        "slora_tokens_per_s_5": small["tokens_per_s"],
        "slora_tokens_per_s_2000": large["tokens_per_s"],
        "slora_throughput_ratio": ratio,
        "slora_ratio_per_round": per_round,
        "slora_forward_cpu_ratio": fwd,
        "slora_process_cpu_ratio": proc,
        "slora_forward_cpu_ms_per_token": [small["forward_cpu_ms_per_token"], large["forward_cpu_ms_per_token"]],
        "slora_process_cpu_ms_per_token": [small["process_cpu_ms_per_token"], large["process_cpu_ms_per_token"]],
        "slora_ttft_p95_5_s": small["ttft_p95"],
        "slora_ttft_p95_2000_s": large["ttft_p95"],
        "slora_target_ratio": 0.95,
        "slora_pass": ratio >= 0.95,
    }


async def bench_fairness(model: Path, dirs: list[Path], out: Path, quick: bool) -> dict:
    duration = 12.0 if quick else 30.0
    # Four tenants on an adapter each; t0 floods at 20x each light tenant's rate, past capacity.
    # Eight rows and varied output lengths, so rows free up one by one rather than in waves.
    rates = {"t0": 4.0, "t1": 0.2, "t2": 0.2, "t3": 0.2}
    trace = []
    for i, (tenant, rate) in enumerate(rates.items()):
        one = GenConfig(
            seed=5 + i, rate=rate, duration_s=duration, adapters=1, tenants=1, shared_fraction=0.0, **VARIED
        )
        trace += [with_fields(r, tenant=tenant, model=f"a{i}") for r in generate(one)]
    trace.sort(key=lambda r: r.arrival_s)
    heavy = "t0"
    opts = RunOptions(probe_interval_s=0.5)
    rows = {}
    for scheduler in ("fcfs", "vtc"):
        engine, _ = engine_for(model, dirs, trace_adapters(trace, "base"), scheduler=scheduler, max_num_seqs=8)
        report = await run(engine, trace, opts, out, f"fairness-{scheduler}")
        light = [t for t in report["latency"]["by_tenant"] if t != heavy]
        records = _records(out / f"fairness-{scheduler}")
        light_lat = latency([r for r in records if r.tenant in light])
        rows[scheduler] = {
            "light_ttft_p50": light_lat["ttft"]["p50"],
            "light_ttft_p99": light_lat["ttft"]["p99"],
            "heavy_ttft_p99": p(report, "latency", "by_tenant", heavy, "ttft", "p99"),
            "tokens_per_s": p(report, "throughput", "output_tokens_per_s"),
            "light_requests": light_lat["ttft"]["count"],
            "jain": p(report, "fairness", "jain_index"),
        }
    ratio = rows["fcfs"]["light_ttft_p99"] / rows["vtc"]["light_ttft_p99"]
    print(f"\n2. One tenant flooding ({len(trace)} requests over {duration:g} s, open loop, rates {rates} req/s)")
    header = ["scheduler", "light TTFT p50 (ms)", "light TTFT p99 (ms)", "heavy TTFT p99 (ms)", "output tokens/s"]
    cells = [
        [name, ms(r["light_ttft_p50"]), ms(r["light_ttft_p99"]), ms(r["heavy_ttft_p99"]), f"{r['tokens_per_s']:.1f}"]
        + [r["light_requests"]]
        for name, r in rows.items()
    ]
    print(table([*header, "light requests"], cells, "lrrrrr"))
    print(f"light tenants' p99 TTFT, FCFS / VTC: {ratio:.2f} (target >= 2)")
    return {
        "fairness_requests": len(trace),
        "fairness_light_ttft_p99_fcfs_s": rows["fcfs"]["light_ttft_p99"],
        "fairness_light_ttft_p99_vtc_s": rows["vtc"]["light_ttft_p99"],
        "fairness_heavy_ttft_p99_fcfs_s": rows["fcfs"]["heavy_ttft_p99"],
        "fairness_heavy_ttft_p99_vtc_s": rows["vtc"]["heavy_ttft_p99"],
        "fairness_light_p99_ratio": ratio,
        "fairness_target_ratio": 2.0,
        "fairness_pass": ratio >= 2.0,
    }


def _records(run_dir: Path):
    from lorapage.traces.records import read_records

    return read_records(run_dir / "records.jsonl")


async def bench_seed(model: Path, dirs: list[Path], out: Path, quick: bool, scale: float = 0.02) -> dict:
    cfg = GenConfig(
        seed=3, scale=scale, duration_s=20.0 if quick else 60.0, system_prompt_len=16, shared_fraction=0.3, **SHORT
    )
    trace = generate(cfg)
    names = trace_adapters(trace, "base")
    adapters = cfg.scaled_adapters()
    engine, _ = engine_for(model, dirs, [f"a{k:0{len(str(adapters - 1))}d}" for k in range(adapters)], max_loras=16)
    report = await run(engine, trace, RunOptions(probe_interval_s=0.5), out, "seed")
    tiers = report["latency"]["by_tier"]
    warm = p(report, "latency", "by_tier", "gpu", "ttft", "p95")
    records = [r for r in _records(out / "seed") if r.tier in ("ram", "disk")]
    cold_lat = latency(records)["ttft"]
    cold = cold_lat["p95"]
    print(
        f"\n3. Seed workload x{scale}: {len(trace)} requests over {cfg.duration_s:g} s at {cfg.scaled_rate():g} req/s, "
        f"{adapters} adapters registered ({len(names)} in the trace), Zipf({cfg.zipf_alpha}), max_loras 16"
    )
    cells = [
        [
            tier,
            t["count"],
            ms(t["p50"]),
            ms(t["p95"]),
            ms(t["p99"]),
            f"{p(report, 'goodput', 'by_tier', tier, 'fraction'):.2f}",
        ]
        for tier, t in ((tier, lat["ttft"]) for tier, lat in tiers.items())
    ]
    header = ["tier", "requests", "TTFT p50 (ms)", "TTFT p95 (ms)", "TTFT p99 (ms)", "goodput"]
    print(table(header, cells, "lrrrrr"))
    print(f"warm (gpu) p95 {ms(warm)} ms (target < 1,000); cold (ram + disk) p95 {ms(cold)} ms (target < 2,000)")
    return {
        "seed_requests": len(trace),
        "seed_rate": cfg.scaled_rate(),
        "seed_ttft_p95_warm_s": warm,
        "seed_ttft_p95_cold_s": cold,
        "seed_cold_requests": cold_lat["count"],
        "seed_goodput_fraction": p(report, "goodput", "fraction"),
        "seed_target_warm_s": 1.0,
        "seed_target_cold_s": 2.0,
        "seed_pass": warm is not None and cold is not None and warm < 1.0 and cold < 2.0,
    }


BENCHES = {"slora": bench_slora, "fairness": bench_fairness, "seed": bench_seed}


async def main(args: argparse.Namespace) -> dict:
    out = Path(args.out or tempfile.mkdtemp(prefix="lorapage-bench-replay-"))  # the reports stay
    figures: dict = {"bench": "replay", "quick": args.quick, "reports": str(out), **machine_info()}
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-model-") as tmp:  # the model and adapters do not
        model, dirs = make_assets(Path(tmp))
        for name in args.only.split(","):
            extra = (
                {"scale": args.seed_scale}
                if name == "seed"
                else {"rounds": args.rounds, "lora_dtype": args.lora_dtype}
                if name == "slora"
                else {}
            )
            figures |= await BENCHES[name](model, dirs, out, args.quick, **extra)
    figures["pass"] = all(v for k, v in figures.items() if k.endswith("_pass"))
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests: a smoke run")
    parser.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {','.join(BENCHES)}")
    parser.add_argument("--rounds", type=int, default=4, help="S-LoRA headline: passes of each configuration")
    parser.add_argument(
        "--lora-dtype", default="auto", choices=LORA_DTYPE_NAMES, help="S-LoRA headline: the engines' lora_dtype"
    )
    parser.add_argument("--seed-scale", type=float, default=0.02, help="scale of the seed workload (0.02: 0.8 req/s)")
    parser.add_argument("--out", default=None, help="where the runs' reports go (default: a temporary directory)")
    print_json(asyncio.run(main(parser.parse_args())))

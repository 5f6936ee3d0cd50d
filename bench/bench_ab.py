"""A/B of engine configurations and kernel revisions on the S-LoRA headline's trace, paired by round.

One pass of `bench_replay.py --only slora` swings by +-10% with the shared cores' load, and a
machine's speed drifts over a run: more than most changes being measured. So each round runs
every variant on both of the headline's cases (5 and 2,000 registered adapters), each pass on a
fresh engine, in an order that reverses every round; each variant is then compared with the
first one *within* each round, and the medians of those per-round ratios are reported beside
the medians of throughput.

    python bench/bench_ab.py [--rounds 3] [--requests 192] VARIANT [VARIANT ...]

VARIANT is ``NAME`` or ``NAME:KEY=VALUE,...``. A KEY is an ``EngineConfig`` field, its VALUE JSON
where it parses (``gil_switch_interval_s=null``), else a string (``lora_dtype=bfloat16``); or
``kernels=REV``: the CPU path's C kernels built from git revision REV's sources (which must have
today's C signatures) instead of the working tree's. Run it as the headline is run, e.g.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_ab.py before:kernels=HEAD~1 after
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_ab.py fp32 bf16:lora_dtype=bfloat16

Prints a table; the last line is one JSON object with every pass's throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import subprocess
import tempfile
from pathlib import Path

import workloads
from harness import interleaved, machine_info, machine_line, median, print_json, table

from lorapage.kernels import cpu_build, lora_cpu

CASES = (5, workloads.SLORA_ADAPTERS)
ROOT = Path(__file__).resolve().parent.parent


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, fields = text.partition(":")
    config: dict = {}
    for item in filter(None, fields.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"variant {name!r}: {item!r} is not KEY=VALUE")
        try:
            config[key] = json.loads(raw)
        except json.JSONDecodeError:
            config[key] = raw
    return name, config


def kernels_at(rev: str, into: Path) -> ctypes.CDLL:
    """The C kernels built from ``rev``'s sources (written under ``into``)."""
    into.mkdir(parents=True, exist_ok=True)
    for source in cpu_build.SOURCES:
        path = source.relative_to(ROOT).as_posix()
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, check=False)
        if shown.returncode == 0:  # an older revision may lack a file today's build reads
            (into / source.name).write_bytes(shown.stdout)
    return cpu_build.load_from(into)


async def main(args: argparse.Namespace) -> dict:
    variants = [parse_variant(v) for v in args.variants]
    if len({n for n, _ in variants}) < len(variants):
        raise SystemExit("variant names must differ")
    small, big = workloads.slora_traces(args.requests)
    tps: dict[tuple[str, int], list[float]] = {(n, c): [] for n, _ in variants for c in CASES}
    default_kernels = cpu_build.cpu_kernels()
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-ab-") as tmp:
        model, dirs = workloads.make_assets(Path(tmp))
        libs = {n: kernels_at(cfg["kernels"], Path(tmp) / n) for n, cfg in variants if "kernels" in cfg}
        jobs = [(n, cfg, case) for n, cfg in variants for case in CASES]
        for i, (name, cfg, case) in interleaved(args.rounds, jobs):
            lib = libs.get(name, default_kernels)
            # The CPU ops look their library up on every call: this pass's engine runs on it.
            lora_cpu.cpu_kernels = lambda lib=lib: lib
            config = {k: v for k, v in cfg.items() if k != "kernels"}
            names = [f"a{k:04d}" for k in range(case)]
            engine, _ = workloads.engine_for(model, dirs, names, **config)
            report = await workloads.run(
                engine,
                small if case == 5 else big,
                workloads.SLORA_OPTIONS,
                Path(tmp) / "reports",
                f"{name}-{case}-{i}",
            )
            tps[(name, case)].append(report["throughput"]["output_tokens_per_s"])
            print(f"round {i + 1}: {name} {case:,}: {tps[(name, case)][-1]:.1f} tokens/s", flush=True)
    lora_cpu.cpu_kernels = cpu_build.cpu_kernels
    first, many = variants[0][0], CASES[1]
    rows: list[dict] = []
    for name, cfg in variants:
        a, b = tps[(name, 5)], tps[(name, many)]
        rows.append(
            {
                "variant": name,
                "config": cfg,
                "tokens_per_s_5": median(a),
                "tokens_per_s_2000": median(b),
                "ratio": median(b) / median(a),
                "ratio_per_round": [y / x for x, y in zip(a, b)],
                "vs_first_5": median(x / f for x, f in zip(a, tps[(first, 5)])),
                "vs_first_2000": median(y / f for y, f in zip(b, tps[(first, many)])),
                "passes_5": a,
                "passes_2000": b,
            }
        )
    print("\n" + machine_line())
    print(f"S-LoRA trace ({args.requests} requests, 32 in flight), {args.rounds} rounds, order reversing each round")
    print(f"medians; 'vs {first}': the median over rounds of this variant's tokens/s over {first}'s in that round")
    header = [
        "variant",
        "config",
        "5 tok/s",
        "2,000 tok/s",
        "2,000 / 5 (per round)",
        f"5 vs {first}",
        f"2,000 vs {first}",
    ]
    cells = [
        [
            r["variant"],
            ", ".join(f"{k}={v}" for k, v in r["config"].items()) or "as built",
            f"{r['tokens_per_s_5']:.1f}",
            f"{r['tokens_per_s_2000']:.1f}",
            f"{r['ratio']:.3f} ({', '.join(f'{x:.2f}' for x in r['ratio_per_round'])})",
            f"{r['vs_first_5']:.3f}",
            f"{r['vs_first_2000']:.3f}",
        ]
        for r in rows
    ]
    print(table(header, cells, "llrrrrr"))
    return {
        "bench": "ab",
        "requests": args.requests,
        "rounds": args.rounds,
        "variants": rows,
        **machine_info(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="NAME[:KEY=VALUE,...]; KEY an EngineConfig field or kernels=REV")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=192)
    print_json(asyncio.run(main(parser.parse_args())))

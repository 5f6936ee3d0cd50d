"""VTC against FCFS on mixed-adapter batches through the embedded engine: what fairness costs in
throughput, steps and rows per step.

On a small generated Llama-shaped model (fp32, CPU) with rank-16 adapters on every module, each
configuration runs one batch of requests submitted together, 16-token prompts, 32 greedy tokens each:

  8x4@8     8 adapters at max_loras=8, 32 requests, request i on adapter i mod 8 (issue 27's case)
  32x4@32   32 adapters at max_loras=32, 128 requests, request i on adapter i mod 32
  zipf@16   64 requests over 16 adapters with Zipf(1.0) counts (19, 10, 6, 5, 4, 3, 3, 2, 2, 2, 2,
            2, 1, 1, 1, 1), in a fixed shuffled order, from 4 tenants, at max_loras=16

through one engine with ``scheduler="vtc"`` and one with ``"fcfs"``, all configurations and both
schedulers interleaved round by round, which of the two goes first alternating (the machine is
noisy). Throughput is generated tokens over the wall time of the batch; steps and rows per step
come from the engine's scheduler metrics. Each figure is the median of its rounds, the VTC / FCFS
ratio the median of the per-round ratios.
Then the policy-only companion: the same batches through the real policies in the simulator on a
virtual clock (deterministic: ``tests/scheduler/test_vtc_lanes.py`` asserts these counts).

    python bench/bench_lanes.py [--rounds N] [--threads T] [--quick]

Target: VTC >= 0.95x FCFS throughput in every configuration. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from harness import machine_info, machine_line, median, print_json
from make_llama import write_adapter, write_model

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.replay.population import zipf_weights
from lorapage.scheduler import VtcConfig, make_policy
from lorapage.sim import SimConfig, SimRequest, Simulator

SHAPE = dict(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408, vocab=4096)
RANK = 16
PROMPT_LEN = 16
NEW_TOKENS = 32
SCHEDULERS = ("vtc", "fcfs")
TARGET_RATIO = 0.95


@dataclass(frozen=True)
class Mix:
    """One configuration: request i runs on ``adapters[i]`` for ``tenants[i]``."""

    name: str
    max_loras: int
    adapters: tuple[str, ...]
    tenants: tuple[str | None, ...]

    @property
    def distinct(self) -> int:
        return len(set(self.adapters))


def zipf_counts(requests: int, adapters: int, alpha: float) -> list[int]:
    """Requests per adapter, most popular first: Zipf(alpha) shares of ``requests``, at least one
    each, the rest going to the largest remainders."""
    shares = zipf_weights(adapters, alpha) * requests
    counts = [max(1, int(s)) for s in shares]
    by_remainder = sorted(range(adapters), key=lambda k: int(shares[k]) - shares[k])
    for k in by_remainder[: requests - sum(counts)]:
        counts[k] += 1
    return counts


def mixes(quick: bool) -> list[Mix]:
    def round_robin(n: int, per: int) -> tuple[str, ...]:
        return tuple(f"a{i % n}" for i in range(n * per))

    zipf = [f"a{k}" for k, c in enumerate(zipf_counts(64, 16, 1.0)) for _ in range(c)]
    random.Random(0).shuffle(zipf)
    out = [
        Mix("8x4@8", 8, round_robin(8, 4), (None,) * 32),
        Mix("32x4@32", 32, round_robin(32, 4), (None,) * 128),
        Mix("zipf@16", 16, tuple(zipf), tuple(f"t{i % 4}" for i in range(64))),
    ]
    return out[:1] + out[2:] if quick else out


def prompt(i: int) -> list[int]:
    """Request ``i``'s prompt, the same in every configuration and round."""
    return [(7 * i + j) % 200 + 3 for j in range(PROMPT_LEN)]


async def run_batch(engine: Engine, mix: Mix, new_tokens: int) -> dict[str, float]:
    """One batch of ``mix`` through ``engine``: tokens/s, steps and mean rows per step."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    hist = engine.metrics().scheduler.batch_size
    steps, rows = hist.count, hist.sum

    async def one(i: int) -> int:
        last = None
        async for last in engine.generate(prompt(i), mix.adapters[i], params, tenant=mix.tenants[i]):
            pass
        assert last is not None
        return len(last.token_ids)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(len(mix.adapters)))))
    wall = time.perf_counter() - start
    steps, rows = hist.count - steps, hist.sum - rows
    return {"tok_s": tokens / wall, "steps": steps, "rows_per_step": rows / steps}


def policy_counts(mix: Mix, scheduler: str, new_tokens: int) -> dict[str, float]:
    """Steps and mean rows per step of ``mix`` through the real policy on the simulator's virtual
    clock, every request arriving at t=0 with its adapter resident."""
    trace = [
        SimRequest(f"r{i}", mix.tenants[i] or "default", a, 0.0, PROMPT_LEN, new_tokens)
        for i, a in enumerate(mix.adapters)
    ]
    policy = make_policy(scheduler, vtc=VtcConfig(max_loras=mix.max_loras))
    sim = Simulator(policy, SimConfig(max_num_seqs=len(trace), adapter_load_s=0.0), trace)  # adapters resident
    rows: list[int] = []
    sim.run(on_step=lambda s: rows.append(s.last_batch_size))
    return {"steps": sim.steps, "rows_per_step": sum(rows) / len(rows)}


async def measure(root: Path, rounds: int, quick: bool) -> dict:
    model = write_model(root / "base", **SHAPE)
    runs = mixes(quick)
    needed = max(m.distinct for m in runs)
    paths = [write_adapter(root / f"a{k}", model, rank=RANK, seed=k) for k in range(needed)]
    new_tokens = 16 if quick else NEW_TOKENS
    engines: dict[tuple[str, str], Engine] = {}
    for mix in runs:
        for scheduler in SCHEDULERS:
            engine = Engine(
                EngineConfig(
                    model=str(model),
                    max_loras=mix.max_loras,
                    max_lora_rank=RANK,
                    max_cpu_loras=mix.max_loras,
                    max_num_seqs=len(mix.adapters),
                    max_model_len=PROMPT_LEN + NEW_TOKENS,
                    scheduler=scheduler,
                    enable_prefix_caching=False,  # every round reuses its prompts
                )
            )
            for k in range(mix.distinct):
                engine.add_adapter(f"a{k}", paths[k])
                await engine.admin.load(f"a{k}")
            await run_batch(engine, Mix("warm-up", mix.max_loras, mix.adapters[:4], (None,) * 4), 2)
            engines[mix.name, scheduler] = engine
    samples: dict[tuple[str, str], list[dict[str, float]]] = {key: [] for key in engines}
    for turn in range(rounds):
        for mix in runs:
            for scheduler in SCHEDULERS[:: 1 if turn % 2 == 0 else -1]:  # who goes first alternates
                samples[mix.name, scheduler].append(await run_batch(engines[mix.name, scheduler], mix, new_tokens))
    for engine in engines.values():
        await engine.close()
    out = {}
    for mix in runs:
        vtc, fcfs = samples[mix.name, "vtc"], samples[mix.name, "fcfs"]
        out[mix.name] = {
            "requests": len(mix.adapters),
            "adapters": mix.distinct,
            "max_loras": mix.max_loras,
            "ratio": median(v["tok_s"] / f["tok_s"] for v, f in zip(vtc, fcfs)),
            **{
                f"{name}_{key}": median(s[key] for s in runs_of)
                for name, runs_of in (("vtc", vtc), ("fcfs", fcfs))
                for key in ("tok_s", "steps", "rows_per_step")
            },
            **{
                f"sim_{scheduler}_{key}": value
                for scheduler in SCHEDULERS
                for key, value in policy_counts(mix, scheduler, new_tokens).items()
            },
        }
    return out


def report(results: dict, rounds: int, threads: int, new_tokens: int) -> dict:
    print(machine_line())
    print(
        f"VTC vs FCFS, one batch per configuration: {PROMPT_LEN}-token prompts, {new_tokens} greedy tokens; "
        f"hidden {SHAPE['hidden']} x {SHAPE['layers']} layers fp32, rank-{RANK} adapters on every module; "
        f"{threads} CPU thread(s); median of {rounds} interleaved rounds"
    )
    print(
        f"{'config':<9}{'reqs':>5}{'lanes':>6} | {'vtc tok/s':>10}{'fcfs tok/s':>11}{'ratio':>7} | "
        f"{'steps vtc':>10}{'fcfs':>6} | {'rows/step vtc':>14}{'fcfs':>7} | {'sim steps vtc':>14}{'fcfs':>6}"
        f"{'sim rows vtc':>14}{'fcfs':>7}"
    )
    for name, r in results.items():
        print(
            f"{name:<9}{r['requests']:>5}{r['max_loras']:>6} | {r['vtc_tok_s']:>10.0f}{r['fcfs_tok_s']:>11.0f}"
            f"{r['ratio']:>7.2f} | {r['vtc_steps']:>10.0f}{r['fcfs_steps']:>6.0f} | {r['vtc_rows_per_step']:>14.1f}"
            f"{r['fcfs_rows_per_step']:>7.1f} | {r['sim_vtc_steps']:>14}{r['sim_fcfs_steps']:>6}"
            f"{r['sim_vtc_rows_per_step']:>14.1f}{r['sim_fcfs_rows_per_step']:>7.1f}"
        )
    worst = min(r["ratio"] for r in results.values())
    print(f"worst VTC / FCFS throughput: {worst:.2f} (target >= {TARGET_RATIO})")
    rounded = {
        name: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for name, r in results.items()
    }
    return {
        "bench": "lanes",
        "threads": threads,
        "rounds": rounds,
        "new_tokens": new_tokens,
        "configs": rounded,
        "min_ratio": round(worst, 3),
        "target_ratio": TARGET_RATIO,
        "pass": worst >= TARGET_RATIO,
        **machine_info(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds; figures are their medians")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of the forward pass")
    parser.add_argument("--quick", action="store_true", help="two configurations, 16 tokens, one round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="lorapage-bench-lanes-") as tmp:
        results = asyncio.run(measure(Path(tmp), rounds, args.quick))
    print_json(report(results, rounds, args.threads, 16 if args.quick else NEW_TOKENS))


if __name__ == "__main__":
    main()

"""Prefix caching on a multi-tenant chat workload: prefill tokens computed and TTFT, on vs off.

Several tenants, each with its own adapter and a long system prompt of its own, hold multi-turn
chats: every turn resends the system prompt and the whole history (the model's answers
included), then asks for a short answer. A tenant's chats start one after another's first answer
(customers arrive over time) and then run side by side.
The same requests run through two engines in one run, one after the other: caching off, then on.
Figures: prompt tokens actually computed (the rest were cache hits), TTFT p50 / p95, hit rate.
Targets: >= 4x fewer prefill tokens and >= 2x lower TTFT p50 with caching.

    python bench/bench_prefix.py [--tenants 4] [--chats 3] [--turns 4] [--system 512]

Prints a table, then one JSON line with the figures and targets.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import machine_info, machine_line, print_json
from make_llama import write_adapter, write_model

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.traces.stats import percentile

TARGETS = {"prefill_token_ratio": 4.0, "ttft_p50_ratio": 2.0}


def workload(args: argparse.Namespace) -> dict[str, tuple[list[int], list[list[int]]]]:
    """Per tenant, its system prompt and, per chat, the user tokens of each turn."""
    rng = np.random.default_rng(0)
    return {
        f"t{t}": (
            rng.integers(3, 4000, args.system).tolist(),
            [[rng.integers(3, 4000, args.user).tolist() for _ in range(args.turns)] for _ in range(args.chats)],
        )
        for t in range(args.tenants)
    }


async def run(engine: Engine, chats: dict, args: argparse.Namespace) -> dict:
    """Every tenant's chats: a chat starts once the tenant's previous one has had its first
    answer (customers arrive over time), and each turn resends the system prompt and the whole
    history, the model's own answers included."""
    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []

    async def chat(
        tenant: str, system: list[int], turns: list[list[int]], after: asyncio.Event | None, answered: asyncio.Event
    ) -> None:
        if after is not None:
            await after.wait()
        history = list(system)
        for user in turns:
            history += user
            t0, first, out = time.perf_counter(), None, None
            async for out in engine.generate(history, f"lora-{tenant}", params, tenant=tenant):
                if first is None:
                    first = time.perf_counter() - t0
            ttfts.append(first or 0.0)
            answered.set()
            history += out.token_ids if out is not None else []

    tasks = []
    for tenant, (system, conversations) in chats.items():
        previous = None
        for turns in conversations:
            answered = asyncio.Event()
            tasks.append(chat(tenant, system, turns, previous, answered))
            previous = answered
    await asyncio.gather(*tasks)
    hits = sum(engine.debug.step_planner.prefix_hit_tokens.values())
    total = sum(engine.debug.step_planner.prefix_query_tokens.values())
    await engine.close()
    return {
        "prompt_tokens": total,
        "prefill_tokens_computed": total - hits,
        "hit_rate": hits / total if total else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "requests": len(ttfts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--chats", type=int, default=3, help="chats per tenant, run concurrently")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=512, help="system prompt tokens per tenant")
    parser.add_argument("--user", type=int, default=48, help="new user tokens per turn")
    parser.add_argument("--answer", type=int, default=16, help="tokens generated per turn")
    args = parser.parse_args()
    chats = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(
            Path(tmp) / "model", hidden=384, layers=4, heads=6, kv_heads=2, intermediate=1024, vocab=4096
        )
        adapter = write_adapter(Path(tmp) / "lora", model, rank=16, seed=1)
        figures = {}
        for name, caching in (("off", False), ("on", True)):
            engine = Engine(
                EngineConfig(
                    model=str(model),
                    max_model_len=2048,
                    max_loras=args.tenants,
                    max_lora_rank=16,
                    enable_prefix_caching=caching,
                    kernel_backend="torch",
                )
            )
            for t in range(args.tenants):
                engine.add_adapter(f"lora-t{t}", adapter)  # one registration per tenant: its own namespace
            figures[name] = asyncio.run(run(engine, chats, args))
    off, on = figures["off"], figures["on"]
    token_ratio = off["prefill_tokens_computed"] / max(1, on["prefill_tokens_computed"])
    ttft_ratio = off["ttft_p50_s"] / on["ttft_p50_s"]
    print(machine_line())
    print(
        f"{args.tenants} tenants x {args.chats} chats x {args.turns} turns; system prompt {args.system} tokens, "
        f"+{args.user} user / {args.answer} answer tokens a turn"
    )
    print(f"{'caching':<8} {'prompt tok':>10} {'computed':>9} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p95':>9}")
    for name, f in figures.items():
        print(
            f"{name:<8} {f['prompt_tokens']:>10} {f['prefill_tokens_computed']:>9} {f['hit_rate']:>9.1%} "
            f"{f['ttft_p50_s']:>9.3f} {f['ttft_p95_s']:>9.3f}"
        )
    print(
        f"prefill tokens off / on = {token_ratio:.1f} (target >= {TARGETS['prefill_token_ratio']:g}); "
        f"TTFT p50 off / on = {ttft_ratio:.1f} (target >= {TARGETS['ttft_p50_ratio']:g})"
    )
    print_json(
        {
            "bench": "prefix_caching",
            **{f"{n}_{k}": v for n, f in figures.items() for k, v in f.items()},
            "prefill_token_ratio": token_ratio,
            "ttft_p50_ratio": ttft_ratio,
            "targets": {k: f">={v:g}" for k, v in TARGETS.items()},
            "pass": token_ratio >= TARGETS["prefill_token_ratio"] and ttft_ratio >= TARGETS["ttft_p50_ratio"],
            **machine_info(),
        }
    )


if __name__ == "__main__":
    main()

"""RL rollouts on a LoRA policy pushed from memory at step rate (docs/rl.md, issue 43).

A simulated trainer pushes a new rank-16 all-modules version of ``policy`` (``engine.admin.push``:
tensors and config from memory, ``max_staleness`` k) while rollout groups stream: each group is
one prompt with ``n`` samples, pinned to the version current when it started (``policy@V``, what
``adapter_version`` names over HTTP), processed logprobs on. Three phases on one embedded engine
over the built-in tiny model:

1. rounds alternating rollouts alone and rollouts while a version is pushed every
   ``--interval`` s: throughput with pushes / without (target >= 0.95) and push latency (request to
   current, staged in the pool first) p50 / p99;
2. ``--pushes`` pushes back to back while rollouts stream: push latency p50 / p99, the pool pages
   and host-RAM bytes the adapters hold and the process's RSS sampled along, which must stay flat
   (old versions retired);
3. the usage ledger (each group its own tenant) says which version served each group: 0 served by
   a version other than the one named; and each group's logprobs recomputed by transformers +
   PEFT on the version it named, for a sample of groups (max |dlogprob|, target <= 1e-4, float32).

    python bench/bench_rl.py [--quick] [--groups 6] [--n 8] [--tokens 16] [--pushes 500]

Prints a table, then one JSON line with the figures and targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import machine_line, print_json, table
from make_llama import write_adapter, write_model
from safetensors.torch import load_file

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.tiny import TINY_BASE_DIR

TARGETS = {"throughput_ratio": 0.95, "wrong_version": 0, "max_abs_dlogprob": 1e-4}
RSS_SLACK_MB = 64.0  # allowed growth over the fast pushes (allocator noise, not per-version leaks)


def rss_mb() -> float:
    """The process's resident set now (Linux /proc), in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


class Trainer:
    """Pushes version after version of ``policy``: the first adapter's tensors, one of them
    moved per step (a new digest each time, as a real update is)."""

    def __init__(self, engine: Engine, adapter: Path, staleness: int) -> None:
        self.engine, self.staleness = engine, staleness
        self.tensors = load_file(str(adapter / "adapter_model.safetensors"))
        self.config = json.loads((adapter / "adapter_config.json").read_text())
        self.moved = next(iter(self.tensors))
        self.step, self.latencies = 0, []
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}  # version -> its tensors (for the PEFT check)

    async def push(self) -> int:
        self.step += 1
        tensors = dict(self.tensors)
        tensors[self.moved] = self.tensors[self.moved] + 1e-3 * self.step
        started = time.perf_counter()
        info = await self.engine.admin.push("policy", tensors, self.config, max_staleness=self.staleness)
        self.latencies.append(time.perf_counter() - started)
        self.snapshots[info.version] = tensors
        if len(self.snapshots) > 64:
            self.snapshots.pop(min(self.snapshots))
        return info.version

    async def every(self, interval: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.push()
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass


class Rollouts:
    """Groups of ``n`` samples, each pinned to the version current when it starts."""

    def __init__(self, engine: Engine, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        self.served: list[tuple[str, str, list[int], list[int], list[float]]] = []  # tenant, key, prompt, tokens, lps
        self.count = 0

    async def group(self, rng: random.Random) -> int:
        a = self.args
        self.count += 1
        tenant = f"g{self.count}"
        key = self.engine.admin.catalog.resolve_version("policy")  # the trainer's adapter_version
        prompt = [rng.randrange(3, 250) for _ in range(a.prompt)]
        sampling = SamplingParams(
            n=a.n, max_tokens=a.tokens, temperature=1.0, top_p=0.95, seed=rng.randrange(1 << 30), logprobs=0,
            logprobs_mode="processed_logprobs", ignore_eos=True,
        )  # fmt: skip
        last = {}
        async for out in self.engine.generate(prompt, key, sampling, tenant=tenant):
            last[out.index] = out
        for out in last.values():
            self.served.append((tenant, key, prompt, out.token_ids, [x.logprob for x in out.logprobs or []]))
        return sum(len(o.token_ids) for o in last.values())

    async def run(self, seconds: float, seed: int) -> float:
        """Tokens per second over ``seconds`` with ``groups`` groups in flight."""
        rng, tokens, deadline = random.Random(seed), 0, time.perf_counter() + seconds
        started = time.perf_counter()

        async def worker(k: int) -> None:
            nonlocal tokens
            local = random.Random(rng.randrange(1 << 30) + k)
            while time.perf_counter() < deadline:
                tokens += await self.group(local)

        await asyncio.gather(*(worker(k) for k in range(self.args.groups)))
        return tokens / (time.perf_counter() - started)


def wrong_versions(engine: Engine, rollouts: Rollouts) -> int:
    """Groups the usage ledger charged to a version other than the one they named."""
    named = {tenant: key for tenant, key, *_ in rollouts.served}
    wrong = 0
    for (_, tenant, adapter), _usage in engine.usage_rows(tenants=set(named)):
        wrong += adapter != named[tenant]
    return wrong


def peft_agreement(base: Path, trainer: Trainer, rollouts: Rollouts, samples: int) -> tuple[float, int, float]:
    """Max |dlogprob| between the engine's processed logprobs and transformers + PEFT's on the
    version each sampled rollout named (top-p 0.95 at temperature 1, applied to PEFT's logits),
    the sequences checked and their mean logprob (far from 0: the distributions are not one-hot)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import TopPLogitsWarper

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = trainer.config
    peft = get_peft_model(
        model, LoraConfig(r=cfg["r"], lora_alpha=cfg["lora_alpha"], target_modules=cfg["target_modules"])
    )
    peft.eval()
    chosen = [r for r in rollouts.served if int(r[1].rpartition("@")[2]) in trainer.snapshots][-samples:]
    worst, total, count = 0.0, 0.0, 0
    for _, key, prompt, tokens, lps in chosen:
        set_peft_model_state_dict(peft, trainer.snapshots[int(key.rpartition("@")[2])])
        with torch.no_grad():
            logits = peft(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(TopPLogitsWarper(0.95)(None, logits), -1)
        got = torch.tensor(lps)
        worst = max(worst, float((ref[torch.arange(len(tokens)), torch.tensor(tokens)] - got).abs().max()))
        total, count = total + float(got.sum()), count + len(lps)
    return worst, len(chosen), total / max(count, 1)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values[0] if values else 0.0)


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-rl-"))
    vocab = json.loads((TINY_BASE_DIR / "config.json").read_text())["vocab_size"]
    base = write_model(
        root / "base", hidden=args.hidden, layers=2, heads=4, kv_heads=2, intermediate=2 * args.hidden, vocab=vocab
    )
    adapter = write_adapter(root / "policy", base, rank=16, seed=1, std=0.05)
    engine = Engine(EngineConfig(model=str(base), dtype="float32", max_lora_rank=16, max_num_seqs=args.groups * args.n))
    trainer, rollouts = Trainer(engine, adapter, args.staleness), Rollouts(engine, args)
    try:
        await trainer.push()
        await rollouts.run(1.0, seed=99)  # warm up
        rates: dict[str, list[float]] = {"alone": [], "pushes": []}
        interval_latencies: list[float] = []
        for r in range(args.rounds):
            for variant in ("alone", "pushes") if r % 2 == 0 else ("pushes", "alone"):
                if variant == "alone":
                    rates["alone"].append(await rollouts.run(args.seconds, seed=r))
                    continue
                stop, before = asyncio.Event(), len(trainer.latencies)
                pusher = asyncio.create_task(trainer.every(args.interval, stop))
                rates["pushes"].append(await rollouts.run(args.seconds, seed=r))
                stop.set()
                await pusher
                interval_latencies += trainer.latencies[before:]
        # Phase 2: pushes back to back while rollouts stream; the pool and RSS sampled along.
        free, host, rss, fast = [], [], [], len(trainer.latencies)
        stop = asyncio.Event()

        async def stream() -> None:
            while not stop.is_set():
                await rollouts.run(0.5, seed=len(free))

        streaming = asyncio.create_task(stream())
        for i in range(args.pushes):
            await trainer.push()
            if i % max(1, args.pushes // 10) == 0 or i == args.pushes - 1:
                residency = engine.debug.residency
                free.append(sum(residency.slots.resident_pages().values()))
                host.append(residency.host.nbytes / 1e6)
                rss.append(rss_mb())
        stop.set()
        await streaming
        fast_latencies = trainer.latencies[fast:]
        wrong = wrong_versions(engine, rollouts)
        resident = sorted(k for k in engine.debug.adapters.entries if k.startswith("policy@"))
        worst, checked, mean_lp = peft_agreement(base, trainer, rollouts, args.peft_samples)
    finally:
        await engine.close()

    ratio = statistics.median(rates["pushes"]) / statistics.median(rates["alone"])
    rss_growth = max(rss[len(rss) // 2 :]) - rss[len(rss) // 2 - 1] if len(rss) > 2 else 0.0
    summary = {
        "bench": "rl",
        "groups": args.groups,
        "n": args.n,
        "tokens_per_s_alone": round(statistics.median(rates["alone"]), 1),
        "tokens_per_s_pushes": round(statistics.median(rates["pushes"]), 1),
        "throughput_ratio": round(ratio, 3),
        "interval_s": args.interval,
        "interval_pushes": len(interval_latencies),
        "interval_push_ms_p50": round(1e3 * pct(interval_latencies, 50), 1),
        "interval_push_ms_p99": round(1e3 * pct(interval_latencies, 99), 1),
        "fast_pushes": len(fast_latencies),
        "fast_push_ms_p50": round(1e3 * pct(fast_latencies, 50), 1),
        "fast_push_ms_p99": round(1e3 * pct(fast_latencies, 99), 1),
        "adapter_pool_pages": [min(free), max(free)],
        "adapter_host_mb": [round(min(host), 2), round(max(host), 2)],
        "rss_mb_first_last": [round(rss[0], 1), round(rss[-1], 1)],
        "rss_growth_mb_second_half": round(rss_growth, 1),
        "versions_kept": len(resident),
        "max_staleness": args.staleness,
        "rollout_sequences": len(rollouts.served),
        "wrong_version": wrong,
        "peft_checked": checked,
        "max_abs_dlogprob": worst,
        "mean_logprob_checked": round(mean_lp, 3),
        "targets": TARGETS,
        "met": ratio >= TARGETS["throughput_ratio"] and wrong == 0 and worst <= TARGETS["max_abs_dlogprob"],
    }
    print(machine_line())
    rows = [
        [f"rollout tokens/s alone / with a push every {args.interval} s",
         f"{summary['tokens_per_s_alone']} / {summary['tokens_per_s_pushes']} (x{summary['throughput_ratio']})"],
        [f"push latency p50 / p99, every {args.interval} s ({len(interval_latencies)} pushes)",
         f"{summary['interval_push_ms_p50']} / {summary['interval_push_ms_p99']} ms"],
        [f"push latency p50 / p99, back to back ({len(fast_latencies)} pushes)",
         f"{summary['fast_push_ms_p50']} / {summary['fast_push_ms_p99']} ms"],
        ["adapters' pool pages (min, max) over the fast pushes", f"{min(free)}, {max(free)}"],
        ["adapters' host copies MB (min, max)", f"{min(host):.2f}, {max(host):.2f}"],
        ["RSS first / last (MB); growth over the second half",
         f"{rss[0]:.0f} / {rss[-1]:.0f}; {rss_growth:+.1f}"],
        [f"versions kept (max_staleness {args.staleness})", str(len(resident))],
        ["rollout sequences; served by another version than named", f"{len(rollouts.served)}; {wrong}"],
        [f"max abs dlogprob vs PEFT ({checked} sequences, processed; mean logprob {mean_lp:.2f})", f"{worst:.2e}"],
    ]  # fmt: skip
    print(table(["figure", "value"], rows, "lr"))
    print_json(summary)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and pushes (a minute or two)")
    p.add_argument("--groups", type=int, default=6, help="rollout groups in flight (each n sequences)")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16, help="tokens per sequence")
    p.add_argument("--prompt", type=int, default=24, help="prompt tokens")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between pushes in phase 1")
    p.add_argument("--pushes", type=int, default=500, help="back-to-back pushes in phase 2")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=6.0, help="seconds per phase-1 measurement")
    p.add_argument("--staleness", type=int, default=4, help="max_staleness k")
    p.add_argument("--peft-samples", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128, help="the random base model's hidden size (2 layers)")
    args = p.parse_args()
    if args.quick:
        args.pushes, args.rounds, args.seconds = min(args.pushes, 100), 2, 4.0
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))

"""Decode CUDA graphs under tensor parallelism, with the NCCL collectives captured inside them: the
same greedy tokens from TP=2 with graphs, TP=2 with ``--enforce-eager`` and TP=1 with graphs, on
one Llama-shaped model (hidden 512, 4 layers, 8 heads / 4 KV heads, float32) with 4 rank-16
all-module adapters, 6 requests (a batch of 6 replays the graph of 8: two padded rows). Also
checks that the TP=2 engine captured graphs and that its decode steps replayed them (the size rank
0 chose, sent in each step's inputs), and prints each configuration's wall time per step.

    python bench/check_tp_graphs.py [--device cuda|cpu] [--tokens N]

``--device cuda`` needs two GPUs (rank 1 on cuda:1; NCCL refuses two ranks on one device). On a
CPU (gloo) nothing is captured: the three runs are eager, which checks this script only. Prints a
table, then one JSON line; exits 1 when the tokens differ or, on CUDA, when nothing replayed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from harness import machine_line, print_json, table
from make_llama import write_adapter, write_model

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.model.runner import StepInputs

ADAPTERS, REQUESTS, PROMPT = 4, 6, 12
RUNS = (("tp2-graphs", 2, False), ("tp2-eager", 2, True), ("tp1-graphs", 1, False))


def run(model: Path, adapters: list[Path], tp: int, eager: bool, tokens: int, device: str) -> dict:
    config = EngineConfig(
        model=str(model), tensor_parallel_size=tp, max_lora_rank=16, max_num_seqs=8, device=device, enforce_eager=eager
    )
    engine = Engine(config)
    try:
        for i, path in enumerate(adapters):
            engine.add_adapter(f"a{i}", str(path))
        sizes: list[int] = []
        runner = engine.debug.runner
        if runner.send_step is not None:  # the graph size rank 0 sends each step (0: eager)
            send = runner.send_step

            def record(inputs: StepInputs) -> None:
                sizes.append(inputs.graph_size)
                send(inputs)

            runner.send_step = record
        rows = [
            ([(5 * r + j) % 4000 + 1 for j in range(PROMPT)], f"a{r % ADAPTERS}" if r % 3 else None)
            for r in range(REQUESTS)
        ]
        engine.generate_batch(rows[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # loads, warm-up
        sizes.clear()
        started = time.perf_counter()
        outs = engine.generate_batch(rows, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        seconds = time.perf_counter() - started
        return {
            "captured": sorted(runner.graphs.graphs) if runner.graphs is not None else [],
            "replayed_steps": sum(1 for s in sizes if s),
            "replayed_sizes": sorted({s for s in sizes if s}),
            "step_ms": 1e3 * seconds / tokens,
            "tokens": [o.token_ids for o in outs],
        }
    finally:
        asyncio.run(engine.close())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (NCCL, ranks on cuda:0 and cuda:1) or cpu (gloo, eager)")
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_model(root / "base", hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536, vocab=4096)
        adapters = [write_adapter(root / f"a{i}", model, rank=16, seed=i) for i in range(ADAPTERS)]
        results = {name: run(model, adapters, tp, eager, args.tokens, args.device) for name, tp, eager in RUNS}
    want = results["tp2-eager"]["tokens"]
    same = {name: r["tokens"] == want for name, r in results.items()}
    rows = [
        [name, f"{r['step_ms']:.2f}", ",".join(map(str, r["captured"])) or "-", r["replayed_steps"], same[name]]
        for name, r in results.items()
    ]
    print(table(["run", "step ms", "graphs captured", "decode steps replayed", "tokens == tp2-eager"], rows, "lrrrl"))
    graphs = results["tp2-graphs"]
    replayed = bool(graphs["captured"]) and graphs["replayed_steps"] > 0
    ok = all(same.values()) and (replayed or args.device == "cpu")
    print(f"TP=2 graphs == TP=2 eager == TP=1 graphs: {all(same.values())}; TP=2 replayed its graphs: {replayed}")
    summary = {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()}
    print_json(
        {
            "bench": "tp_graphs",
            "device": args.device,
            "tokens_identical": same,
            "tp2_replayed": replayed,
            "ok": ok,
            **summary,
        }
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

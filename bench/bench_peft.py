"""lorapage against transformers + PEFT on a 100-adapter Zipf trace, side by side in one run (issue 27).

The model of ``peer_setup.py`` (hidden 512, 4 layers, vocab 4,096, float32) with 100 rank-16
all-module PEFT adapters. The trace: 64 requests of 8 prompt tokens, each on an adapter drawn from
Zipf(1.0) over the 100 (a fixed seed, so every run and engine gets the same requests and token ids),
32 greedy tokens each, EOS ignored, all submitted at once. Generated tokens/s over the whole batch
(prefill included) of:

  lorapage mixed: ``Engine.generate_batch``, default scheduler (vtc), and fcfs;
  PEFT mixed batch: one ``generate`` of every request, each row on its own adapter (``adapter_names=``);
  PEFT one adapter at a time: one ``generate`` per adapter over its requests, after ``set_adapter``.

Rounds alternate the configurations (each round starts one later) at each thread count of
``--threads``; medians are reported. Greedy tokens are checked against PEFT with each request alone.
Target: lorapage mixed (default scheduler) >= 2.5x PEFT's better mode. ``--quick``: 16 requests,
8 tokens, one round (a smoke run).

Needs transformers and peft (the ``peers`` or ``dev`` extra).

    python bench/bench_peft.py [--quick] [--rounds N] [--threads 1,2] [--requests N] [--zipf A]

Prints a table, then one JSON line with every figure and its target.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from harness import machine_info, machine_line, median, print_json
from peer_setup import (
    PROMPT_LEN,
    Run,
    agreeing,
    agreement_table,
    close,
    interleaved,
    load_peft,
    lorapage_engine,
    lorapage_generate,
    make_adapters,
    make_model,
    medians,
    peft_generate,
    prompts,
    rate_table,
    round_ratios,
)

from lorapage.replay.population import zipf_weights

ADAPTERS, SEED = 100, 0
MAX_LEN = 64
OURS_VTC = "lorapage mixed, default scheduler (vtc)"
OURS_FCFS = 'lorapage mixed, scheduler="fcfs"'
PEFT_MIXED = "PEFT mixed batch (adapter_names=)"
PEFT_GROUPED = "PEFT one adapter at a time (set_adapter)"
CONFIGS = (OURS_VTC, OURS_FCFS, PEFT_MIXED, PEFT_GROUPED)


def trace(requests: int, alpha: float) -> list[tuple[list[int], str | None]]:
    """Request ``i``: its prompt, on an adapter drawn from Zipf(``alpha``) over the 100 (fixed seed)."""
    drawn = np.random.default_rng(SEED).choice(ADAPTERS, size=requests, p=zipf_weights(ADAPTERS, alpha))
    return [(p, f"a{k}") for p, k in zip(prompts(requests), drawn.tolist())]


def measure_at(threads: int, model: Path, adapters: dict[str, Path], peft, rows, new: int, rounds: int):
    """Every configuration at ``threads``: rates per configuration and the last round's tokens."""
    torch.set_num_threads(threads)  # before the engines start their forward threads, which keep it
    vtc, fcfs = (
        lorapage_engine(model, adapters, scheduler=s, max_seqs=len(rows), max_len=MAX_LEN) for s in ("vtc", "fcfs")
    )
    runs: dict[str, Run] = {  # in CONFIGS' order
        OURS_VTC: lambda: lorapage_generate(vtc, rows, new),
        OURS_FCFS: lambda: lorapage_generate(fcfs, rows, new),
        PEFT_MIXED: lambda: peft_generate(peft, rows, new, "mixed"),
        PEFT_GROUPED: lambda: peft_generate(peft, rows, new, "grouped"),
    }
    try:
        return interleaved(runs, rounds, warm=(OURS_VTC, OURS_FCFS))  # the reference pass warmed PEFT up
    finally:
        close(vtc)
        close(fcfs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 requests, 8 tokens, one round (a smoke run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    args = p.parse_args()
    load_start = os.getloadavg()  # the machine's load, reported beside the figures
    threads = [int(t) for t in args.threads.split(",")]
    requests, new, rounds = (16, 8, 1) if args.quick else (args.requests, 32, args.rounds)
    rows = trace(requests, args.zipf)
    with tempfile.TemporaryDirectory(prefix="lorapage-peers-") as tmp:
        root = Path(tmp)
        model = make_model(root)
        adapters = make_adapters(root, model, ADAPTERS)
        peft = load_peft(model, adapters)
        reference = peft_generate(peft, rows, new, "single")[1]
        rates: dict[str, dict[int, list[float]]] = {name: {} for name in CONFIGS}
        agree: dict[str, dict[int, int]] = {name: {} for name in CONFIGS}
        for n in threads:
            per_config, tokens = measure_at(n, model, adapters, peft, rows, new, rounds)
            for name in CONFIGS:
                rates[name][n] = per_config[name]
                agree[name][n] = agreeing(tokens[name], reference)
    report(rates, agree, threads, rows, new, rounds, args.zipf, load_start)


def report(rates, agree, threads, rows, new: int, rounds: int, alpha: float, load_start) -> None:
    med = medians(rates)
    distinct = len({a for _, a in rows})
    print(
        f"model: hidden 512, 4 layers, vocab 4,096, fp32; {len(rows)} requests of {PROMPT_LEN} prompt tokens on "
        f"{distinct} distinct adapters (Zipf({alpha}) over {ADAPTERS}, rank 16, all modules), {new} greedy tokens "
        f"each, EOS ignored; {rounds} interleaved round(s) after a warm-up of lorapage, medians"
    )
    print(rate_table(rates, threads))
    print(agreement_table(agree, threads, len(rows)))
    ratios, per_round = {}, {}
    for t in threads:
        best_peft = max(med[PEFT_MIXED][t], med[PEFT_GROUPED][t])
        ratios[t] = {
            "mixed_over_peft_best": med[OURS_VTC][t] / best_peft,
            "fcfs_mixed_over_peft_best": med[OURS_FCFS][t] / best_peft,
        }
        per_round[t] = {
            "mixed_over_peft_best": round_ratios(rates[OURS_VTC][t], rates[PEFT_MIXED][t], rates[PEFT_GROUPED][t])
        }
        print(
            f"{t} thread(s): lorapage mixed (vtc) / PEFT's best = {ratios[t]['mixed_over_peft_best']:.2f} "
            f"(median per round {median(per_round[t]['mixed_over_peft_best']):.2f}; target >= 2.5; "
            f"fcfs: {ratios[t]['fcfs_mixed_over_peft_best']:.2f})"
        )
    summary = {
        "bench": "peft",
        "threads": threads,
        "rounds": rounds,
        "requests": len(rows),
        "distinct_adapters": distinct,
        "zipf_alpha": alpha,
        "new_tokens": new,
        "tokens_per_s": med,
        "rates_per_round": rates,
        "ratios": ratios,
        "ratios_per_round": per_round,
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "agreeing_requests": agree,
        "targets": {"mixed_over_peft_best": ">=2.5"},
        **machine_info(),
    }
    print(machine_line())
    print_json(summary)


if __name__ == "__main__":
    main()

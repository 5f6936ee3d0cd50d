"""lorapage against llama.cpp on one base and 8 adapters, side by side in one run (issue 27).

The model of ``peer_setup.py`` (hidden 512, 4 layers, vocab 4,096, float32) with 8 rank-16 all-module
adapters; llama.cpp runs float32 GGUF files of the same base and adapters, written by llama.cpp's own
converters (``llamacpp_peer.py`` says where they come from). 32 requests of 8 prompt tokens, request
``i`` on adapter ``i mod 8``, 32 greedy tokens each, EOS ignored; every engine gets the same token ids.
Generated tokens/s over the whole batch (prefill included) of:

  llama.cpp base: the 32 requests on the base, 32 rows per decode call;
  llama.cpp, one adapter at a time: each adapter's 4 requests batched, run to their end, then the next;
  llama.cpp, switch per step: all 32 in flight, 8 decode calls a step, the adapter set before each;
  lorapage mixed: the 32 requests through ``Engine.generate_batch``, default scheduler (vtc), and fcfs;
  lorapage base only: the 32 requests on the base.

Rounds alternate the configurations (each round starts one later), at each thread count of
``--threads`` (torch's threads for lorapage, ``n_threads`` for llama.cpp); medians are reported.
Greedy tokens of each configuration are checked against transformers + PEFT (each request alone);
llama.cpp may differ where two logits nearly tie (it sums in another order). Targets: lorapage mixed
(default scheduler) >= 2x llama.cpp's better multi-adapter mode; lorapage base >= 0.8x llama.cpp base.

Needs the ``peers`` extra (``pip install -e ".[peers]"``; llama-cpp-python builds llama.cpp from source).

    python bench/bench_llamacpp.py [--quick] [--rounds N] [--threads 1,2] [--llama-cpp PATH]

Prints a table, then one JSON line with every figure and its target.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from harness import machine_info, machine_line, median, print_json
from llamacpp_peer import KV_TYPES, LlamaCppPeer, convert, converter_dir
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

REQUESTS, ADAPTERS, NEW = 32, 8, 32
MAX_LEN = 64  # room for PROMPT_LEN + NEW per sequence
LLAMA_BASE = "llama.cpp base, 32 rows per decode call"
LLAMA_GROUPED = "llama.cpp, 8 adapters, one adapter at a time, its requests batched"
LLAMA_SWITCH = "llama.cpp, 8 adapters, 8 decode calls per step, adapter switched before each"
OURS_VTC = "lorapage mixed, default scheduler (vtc)"
OURS_FCFS = 'lorapage mixed, scheduler="fcfs"'
OURS_BASE = "lorapage base only"
CONFIGS = (LLAMA_BASE, LLAMA_GROUPED, LLAMA_SWITCH, OURS_VTC, OURS_FCFS, OURS_BASE)
BASE_CONFIGS = (LLAMA_BASE, OURS_BASE)


def rows(mixed: bool) -> list[tuple[list[int], str | None]]:
    """Request ``i``: its prompt, on adapter ``i mod 8`` (``mixed``) or on the base."""
    return [(p, f"a{i % ADAPTERS}" if mixed else None) for i, p in enumerate(prompts(REQUESTS))]


def llama_run(peer: LlamaCppPeer, mixed: bool, switch_per_step: bool) -> Run:
    batch = rows(mixed)

    def run() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        tokens = peer.generate([p for p, _ in batch], [a for _, a in batch], NEW, switch_per_step=switch_per_step)
        return REQUESTS * NEW / (time.perf_counter() - start), tokens

    return run


def measure_at(
    threads: int, files: tuple[Path, dict[str, Path]], model: Path, adapters: dict[str, Path], rounds: int, kv_type: str
):
    """Every configuration at ``threads``, ``rounds`` interleaved rounds after a warm-up pass: rates
    per configuration, and the last round's tokens."""
    torch.set_num_threads(threads)  # before the engines start their forward threads, which keep it
    peer = LlamaCppPeer(files[0], files[1], threads=threads, max_seqs=REQUESTS, max_len=MAX_LEN, kv_type=kv_type)
    vtc, fcfs = (
        lorapage_engine(model, adapters, scheduler=s, max_seqs=REQUESTS, max_len=MAX_LEN) for s in ("vtc", "fcfs")
    )
    runs: dict[str, Run] = {  # in CONFIGS' order
        LLAMA_BASE: llama_run(peer, mixed=False, switch_per_step=False),
        LLAMA_GROUPED: llama_run(peer, mixed=True, switch_per_step=False),
        LLAMA_SWITCH: llama_run(peer, mixed=True, switch_per_step=True),
        OURS_VTC: lambda: lorapage_generate(vtc, rows(True), NEW),
        OURS_FCFS: lambda: lorapage_generate(fcfs, rows(True), NEW),
        OURS_BASE: lambda: lorapage_generate(vtc, rows(False), NEW),
    }
    try:
        return interleaved(runs, rounds)
    finally:
        close(vtc)
        close(fcfs)
        peer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one round per thread count (a smoke run)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument(
        "--llama-cpp",
        type=Path,
        help="llama.cpp source with its converters, or the llama-cpp-python sdist (.tar.gz); default: "
        "the installed version's sdist, fetched once with pip download",
    )
    p.add_argument("--kv-type", choices=KV_TYPES, default="f16", help="llama.cpp's KV cache type (default: its own)")
    args = p.parse_args()
    load_start = os.getloadavg()  # the machine's load, reported beside the figures
    threads = [int(t) for t in args.threads.split(",")]
    rounds = 1 if args.quick else args.rounds
    tree = converter_dir(args.llama_cpp)
    with tempfile.TemporaryDirectory(prefix="lorapage-peers-") as tmp:
        root = Path(tmp)
        model = make_model(root)
        adapters = make_adapters(root, model, ADAPTERS)
        t = time.perf_counter()
        files = convert(tree, model, adapters, root / "gguf")
        convert_s = time.perf_counter() - t
        peft = load_peft(model, adapters)
        reference = {mixed: peft_generate(peft, rows(mixed), NEW, "single")[1] for mixed in (True, False)}
        del peft
        rates: dict[str, dict[int, list[float]]] = {name: {} for name in CONFIGS}
        agree: dict[str, dict[int, int]] = {name: {} for name in CONFIGS}
        for n in threads:
            per_config, tokens = measure_at(n, files, model, adapters, rounds, args.kv_type)
            for name in CONFIGS:
                rates[name][n] = per_config[name]
                agree[name][n] = agreeing(tokens[name], reference[name not in BASE_CONFIGS])
    report(rates, agree, threads, reference, convert_s, rounds, args.kv_type, load_start)


def report(rates, agree, threads, reference, convert_s: float, rounds: int, kv_type: str, load_start) -> None:
    med = medians(rates)
    adapters_matter = REQUESTS - agreeing(reference[True], reference[False])
    print(
        f"model: hidden 512, 4 layers, vocab 4,096, fp32; {REQUESTS} requests of {PROMPT_LEN} prompt tokens, "
        f"request i on adapter i mod {ADAPTERS} (rank 16, all modules), {NEW} greedy tokens each, EOS ignored; "
        f"{rounds} interleaved round(s) after a warm-up, medians; llama.cpp: f32 GGUF, {kv_type} KV cache "
        f"(conversion took {convert_s:.0f} s)"
    )
    print(rate_table(rates, threads))
    print(agreement_table(agree, threads, REQUESTS) + f"\n(adapters change the tokens of {adapters_matter} requests)")
    ratios, per_round = {}, {}
    for t in threads:
        best_llama = max(med[LLAMA_GROUPED][t], med[LLAMA_SWITCH][t])
        ratios[t] = {
            "mixed_over_llamacpp_best_mixed": med[OURS_VTC][t] / best_llama,
            "fcfs_mixed_over_llamacpp_best_mixed": med[OURS_FCFS][t] / best_llama,
            "base_over_llamacpp_base": med[OURS_BASE][t] / med[LLAMA_BASE][t],
        }
        per_round[t] = {
            "mixed_over_llamacpp_best_mixed": round_ratios(
                rates[OURS_VTC][t], rates[LLAMA_GROUPED][t], rates[LLAMA_SWITCH][t]
            ),
            "base_over_llamacpp_base": round_ratios(rates[OURS_BASE][t], rates[LLAMA_BASE][t]),
        }
        r, pr = ratios[t], {k: median(v) for k, v in per_round[t].items()}
        print(
            f"{t} thread(s): lorapage mixed (vtc) / llama.cpp best mixed = {r['mixed_over_llamacpp_best_mixed']:.2f} "
            f"(median per round {pr['mixed_over_llamacpp_best_mixed']:.2f}; target >= 2.0; "
            f"fcfs: {r['fcfs_mixed_over_llamacpp_best_mixed']:.2f}); lorapage base / llama.cpp base = "
            f"{r['base_over_llamacpp_base']:.2f} (median per round {pr['base_over_llamacpp_base']:.2f}; target >= 0.8)"
        )
    summary = {
        "bench": "llamacpp",
        "threads": threads,
        "rounds": rounds,
        "llamacpp_kv_type": kv_type,
        "tokens_per_s": med,
        "rates_per_round": rates,
        "ratios": ratios,
        "ratios_per_round": per_round,
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "agreeing_requests": agree,
        "requests": REQUESTS,
        "adapters_change_tokens": adapters_matter,
        "targets": {"mixed_over_llamacpp_best_mixed": ">=2.0", "base_over_llamacpp_base": ">=0.8"},
        **machine_info(),
    }
    print(machine_line())
    print_json(summary)


if __name__ == "__main__":
    main()

"""lorapage against llama.cpp at its best, each engine in a process of its own (issues 27, 40).

Two models (``--sizes``): the 512-wide bench model of ``peer_setup.py`` (4 layers, 8 / 4 heads,
vocab 4,096) and a user-sized one (hidden 1,024, 8 layers, 16 / 8 heads, FFN 2,816, vocab 8,192),
random float32 weights, each with 8 rank-16 all-module PEFT adapters. llama.cpp runs GGUF files
written by its own converters (``llamacpp_peer.py``): the float32 base with float32 adapters, and
(``--precisions``) the Q8_0 base its users run with float16 adapters. lorapage runs the checkpoint in
float32 and, against Q8_0, with each of ``--quantizations``: ``int8`` (weight-only, per channel) and
``w8a8`` (the same int8 weights and per-token int8 activations: Q8_0's arithmetic class), with the
logits' ``lm_head`` quantized too (``quantize_lm_head``), as Q8_0 holds the output matrix, and the
adapters in float16 pages (``lora_dtype``), as llama.cpp's are f16; every lorapage engine decodes
``--num-scheduler-steps`` steps a plan (8; multi-step scheduling, docs/scheduling.md). 32
requests of 8 prompt tokens, request ``i`` on adapter ``i mod 8``, 32 greedy tokens each, EOS ignored, the same token ids in every
engine; tokens/s over the whole batch, prefill included.

Each engine runs in a worker process (``peer_proc``): lorapage under this interpreter
(``lorapage_peer.py``, the command's OpenMP settings), llama.cpp under ``--llamacpp-python`` (or
``$LORAPAGE_LLAMACPP_PYTHON``): an interpreter with llama-cpp-python installed, best in a venv of its
own, e.g. ``python3 -m venv /work/lcpp-venv && CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON"
/work/lcpp-venv/bin/pip install llama-cpp-python==0.3.36`` (built from source for this CPU). No two
engines share a process, an OpenMP runtime or a thread pool, and only one runs at a time, except
the one-process-per-core modes, whose processes run together.

llama.cpp's modes: its base, 32 rows per decode call; one adapter at a time (each adapter's 4
requests batched, run to their end, then the next); all 32 in flight with the adapter switched
before each of a step's 8 decode calls. Each mode gets its best setting: a sweep (``--sweep-rounds``
rounds) over flash attention, the KV cache's type and ``n_ubatch`` (``--fa``, ``--kv``,
``--ubatch``) at each thread count; at ``t`` > 1 threads also ``t`` processes of one thread each,
the requests dealt between them by adapter, at the 1-thread sweep's best; lorapage likewise runs
both as one ``t``-thread process and as ``t`` one-thread processes (a host's cores as replicas),
each engine's better one counting. Then every configuration
runs in ``--rounds`` interleaved rounds after a warm-up pass, each round starting one later; medians.
Beside each ratio of medians: the median of the rounds' own ratios, and the ratio by CPU time (each
engine's tokens per CPU second of its processes, every thread: what moves least on a loaded machine).
``--settings FILE`` takes the best settings from an earlier run's JSON line instead of sweeping.

Greedy tokens of every configuration are checked against transformers + PEFT (each request alone,
float32); llama.cpp may differ where two logits nearly tie (it sums in another order), and a
quantized base differs more. Targets at every size and thread count: lorapage mixed (default
scheduler) >= 2x llama.cpp's best multi-adapter configuration, and lorapage base >= 1x llama.cpp's
batched base, at the same weight precision (float32 against f32; int8 against Q8_0).

    python bench/bench_llamacpp.py --llamacpp-python /work/lcpp-venv/bin/python \\
        [--sizes bench,user] [--threads 1,2] [--precisions f32,q8_0] [--rounds 6] [--quick]

Prints the sweep, a table per model, the ratios, then one JSON line with every figure and target.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from harness import machine_info, machine_line, median, print_json, table
from llamacpp_peer import convert, converter_dir
from peer_proc import Worker
from peer_setup import SHAPE, agreeing, interleaved, load_peft, make_adapters, make_model, peft_generate, prompts
from peer_sweep import (
    LLAMA_MODES,
    PRECISIONS,
    Q8_OURS,
    best_settings,
    cell,
    grid,
    llama_name,
    met,
    ours_bases,
    ours_name,
    quantization_of,
    ratios,
    split,
)

SIZES = {
    "bench": SHAPE,
    "user": dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816, vocab=8192),
}
REQUESTS, ADAPTERS, NEW = 32, 8, 32
MAX_LEN = 64  # room for the prompt + NEW per sequence
HERE = Path(__file__).resolve().parent
Rows = list[tuple[list[int], str | None]]
Run = Callable[[], tuple[float, list[list[int]]]]


def rows(mixed: bool) -> Rows:
    """Request ``i``: its prompt, on adapter ``i mod 8`` (``mixed``) or on the base."""
    return [(p, f"a{i % ADAPTERS}" if mixed else None) for i, p in enumerate(prompts(REQUESTS))]


def dealt_run(
    workers: list[Worker], batch: Rows, request: Callable[[list[int]], dict], new: int, cpu: list[float] | None
) -> Run:
    """``batch`` through ``workers`` at once, each sent ``request(its rows)`` for the rows dealt it
    (whole adapter groups, :func:`split`): tokens/s over the slowest worker's seconds, and each
    run's tokens per CPU second (every worker's) on ``cpu``."""
    parts = split([a for _, a in batch], len(workers))

    def run() -> tuple[float, list[list[int]]]:
        for w, part in zip(workers, parts):
            w.send(**request(part))
        tokens: list[list[int]] = [[] for _ in batch]
        seconds = cpu_seconds = 0.0
        for w, part in zip(workers, parts):
            reply = w.receive()
            seconds, cpu_seconds = max(seconds, reply["seconds"]), cpu_seconds + reply["cpu_seconds"]
            for i, t in zip(part, reply["tokens"]):
                tokens[i] = t
        if cpu is not None:
            cpu.append(REQUESTS * new / cpu_seconds)
        return REQUESTS * new / seconds, tokens

    return run


def llama_run(workers: list[Worker], mode: str, setting: str, new: int, cpu: list[float] | None = None) -> Run:
    """``mode`` on llama.cpp, ``new`` tokens a request: one worker, or the requests dealt between
    several running at once."""
    batch = rows(mode != "base")

    def request(part: list[int]) -> dict:
        prompts, adapters = [batch[i][0] for i in part], [batch[i][1] for i in part]
        return dict(op="run", setting=setting, prompts=prompts, adapters=adapters, new=new, switch=mode == "switch")

    return dealt_run(workers, batch, request, new, cpu)


def ours_run(workers: list[Worker], name: str, mixed: bool, new: int, cpu: list[float] | None = None) -> Run:
    """lorapage's engine ``name``, ``new`` tokens a request: one worker, or the requests dealt between
    several running at once, as llama.cpp's processes get them."""
    batch = rows(mixed)
    return dealt_run(
        workers, batch, lambda part: dict(op="run", name=name, rows=[batch[i] for i in part], new=new), new, cpu
    )


class Bench:
    """One model's files and workers, the sweep and the rounds at each thread count."""

    def __init__(self, args: argparse.Namespace, root: Path, size: str, tree: Path):
        self.args, self.root, self.size = args, root, size
        done = root / "ready.json"  # the files below, complete: a --keep directory's second run reuses them
        ready = json.loads(done.read_text()) if done.exists() else {}
        if "reference" not in ready:
            make_model(root, SIZES[size])
            make_adapters(root, root / "base", ADAPTERS)
        self.model = root / "base"
        self.adapters = {f"a{i}": root / f"a{i}" for i in range(ADAPTERS)}
        t = time.perf_counter()
        self.gguf = {}
        for prec in args.precisions:
            base_type, adapter_type = PRECISIONS[prec][:2]
            there = [
                root / "gguf" / f"{n}.gguf"
                for n in (f"base-{base_type}", *(f"{a}-{adapter_type}" for a in self.adapters))
            ]
            if prec not in ready.get("gguf", {}) and all(f.exists() for f in there):
                ready.setdefault("gguf", {})[prec] = [
                    str(there[0]),
                    {a: str(f) for a, f in zip(self.adapters, there[1:])},
                ]
            if prec not in ready.get("gguf", {}):
                files = convert(tree, self.model, self.adapters, root / "gguf", base_type, adapter_type)
                ready.setdefault("gguf", {})[prec] = [str(files[0]), {k: str(v) for k, v in files[1].items()}]
            base, adapters = ready["gguf"][prec]
            self.gguf[prec] = (Path(base), {k: Path(v) for k, v in adapters.items()})
        self.convert_s = time.perf_counter() - t
        done.write_text(json.dumps(ready))
        if "reference" not in ready:
            torch.set_num_threads(1)  # the reference's speed does not matter; on a busy machine 1 thread is safest
            peft = load_peft(self.model, self.adapters)
            ready["reference"] = {str(m): peft_generate(peft, rows(m), NEW, "single")[1] for m in (True, False)}
            del peft
        done.write_text(json.dumps(ready))
        self.reference = {m: ready["reference"][str(m)] for m in (True, False)}
        self.sweeps: dict[str, dict[str, dict[str, list[float]]]] = {}  # "prec@threads" -> mode -> setting
        self.best: dict[str, dict[str, str]] = dict(args.fixed.get(size, {}))
        self.fixed = bool(self.best)
        self.rates: dict[str, dict[str, list[float]]] = {}  # configuration -> column -> rates
        self.cpu_rates: dict[str, dict[str, list[float]]] = {}  # the same by CPU time (tokens per CPU second)
        self.agree: dict[str, dict[str, int]] = {}
        self.used: dict[str, dict[str, str]] = {}  # llama.cpp configuration -> column -> setting

    def lorapage_worker(self, threads: int, tag: str) -> Worker:
        argv = [sys.executable, str(HERE / "lorapage_peer.py"), "--threads", str(threads)]
        return Worker(argv, self.root / f"lorapage-{self.size}-{tag}.log")

    def llama_worker(self, prec: str, threads: int, tag: str) -> Worker:
        log = self.root / f"llama-{self.size}-{prec}-{tag}.log"
        w = Worker([self.args.llamacpp_python, str(HERE / "llamacpp_peer.py")], log, self.args.llama_env)
        base, adapters = self.gguf[prec]
        w.ask(
            op="load",
            model=str(base),
            adapters={k: str(v) for k, v in adapters.items()},
            threads=threads,
            max_seqs=REQUESTS,
            max_len=MAX_LEN,
        )
        return w

    def sweep(self, prec: str, threads: int, worker: Worker) -> dict[str, str]:
        """llama.cpp's best setting per mode at ``threads`` (the sweep's rounds, each setting's modes
        run one after another so one context serves them)."""
        key = f"{prec}@{threads}"
        if key in self.best:
            return self.best[key]
        settings = grid(self.args.fa, self.args.kv, self.args.ubatch)
        per: dict[str, dict[str, list[float]]] = {m: {str(s): [] for s in settings} for m in LLAMA_MODES}
        for r in range(self.args.sweep_rounds):
            for s in settings if r % 2 == 0 else settings[::-1]:
                for mode in LLAMA_MODES:
                    per[mode][str(s)].append(llama_run([worker], mode, str(s), self.args.sweep_tokens)()[0])
        self.sweeps[key] = per
        self.best[key] = best_settings(per)
        for mode in LLAMA_MODES:
            cells = ", ".join(f"{s} {median(v):,.0f}" for s, v in per[mode].items())
            print(f"  sweep {self.size} {prec} {threads}t {mode}: {cells} -> {self.best[key][mode]}", flush=True)
        return self.best[key]

    def measure(self, threads: int) -> None:
        """Every configuration at ``threads`` in interleaved rounds, after llama.cpp's sweep."""
        col, multi, new = str(threads), threads > 1 and not self.args.no_multiprocess, self.args.new
        ours = self.lorapage_worker(threads, col)
        workers = [ours]
        # One lorapage process per core too, as llama.cpp gets (a 2-core host can run two replicas).
        ours_per_core = [self.lorapage_worker(1, f"{col}x1-{k}") for k in range(threads)] if multi else []
        workers += ours_per_core
        runs: dict[str, Run] = {}
        cpu: dict[str, list[float]] = collections.defaultdict(list)
        try:
            for prec in self.args.precisions:
                mine = ours_bases(prec, self.args.quantizations)
                for base in mine:
                    for w in [ours, *ours_per_core]:
                        w.ask(
                            op="load",
                            name=base,
                            model=str(self.model),
                            adapters={k: str(v) for k, v in self.adapters.items()},
                            max_seqs=REQUESTS,
                            max_len=MAX_LEN,
                            quantization=quantization_of(base),
                            quantize_lm_head=quantization_of(base) is not None,  # Q8_0's output matrix is Q8_0
                            # and its adapters are f16: the same 16-bit weights, widened exactly
                            lora_dtype="float16" if quantization_of(base) is not None else "auto",
                            num_scheduler_steps=self.args.num_scheduler_steps,
                        )
                one = self.llama_worker(prec, threads, col)
                workers.append(one)
                best = self.sweep(prec, threads, one)
                for mode in LLAMA_MODES:
                    runs[llama_name(prec, mode)] = llama_run([one], mode, best[mode], new, cpu[llama_name(prec, mode)])
                    self.used.setdefault(llama_name(prec, mode), {})[col] = best[mode]
                for base in mine:
                    for mixed in (True, False):
                        name = ours_name(prec, mixed, base)
                        runs[name] = ours_run([ours], base, mixed, new, cpu[name])
                        if ours_per_core:
                            name = ours_name(prec, mixed, base, threads)
                            runs[name] = ours_run(ours_per_core, base, mixed, new, cpu[name])
                if multi:
                    single = self.best.get(f"{prec}@1") or best
                    procs = [self.llama_worker(prec, 1, f"{col}x1-{k}") for k in range(threads)]
                    workers += procs
                    for mode in LLAMA_MODES:
                        name = llama_name(prec, mode, threads)
                        runs[name] = llama_run(procs, mode, single[mode], new, cpu[name])
                        self.used.setdefault(name, {})[col] = single[mode]
            swept = (
                {llama_name(prec, m) for prec in self.args.precisions for m in LLAMA_MODES} if not self.fixed else set()
            )
            warm = [name for name in runs if name not in swept]  # the sweep warmed these (weights paged in)
            per_config, tokens = interleaved(runs, self.args.rounds, warm)
        finally:
            for w in workers:
                w.close()
        for name, rates in per_config.items():
            self.rates.setdefault(name, {})[col] = rates
            self.cpu_rates.setdefault(name, {})[col] = cpu[name][-len(rates) :]  # the rounds, not the warm-up
            mixed = "base" not in name.split(":")[-1]
            reference = [r[:new] for r in self.reference[mixed]]
            self.agree.setdefault(name, {})[col] = agreeing(tokens[name], reference)

    def report(self, threads: list[int]) -> dict:
        med = {name: {c: median(v) for c, v in per.items()} for name, per in self.rates.items()}
        cols = [str(t) for t in threads]
        shape = SIZES[self.size]
        print(
            f"\n### {self.size} model: hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} / "
            f"{shape['kv_heads']} heads, vocab {shape['vocab']:,}; {REQUESTS} requests x {self.args.new} tokens, "
            f"{self.args.rounds} rounds (GGUF conversion {self.convert_s:.0f} s)\n"
        )
        header = ["configuration (tok/s, median; requests equal to PEFT; llama.cpp setting)"]
        header += [f"{c} thread{'s' if c != '1' else ''}" for c in cols]
        body = [
            [name] + [cell(per.get(c), self.agree[name].get(c), REQUESTS, self.used.get(name, {}).get(c)) for c in cols]
            for name, per in self.rates.items()
        ]
        print(table(header, body, "l" + "r" * len(cols)))
        adapters_matter = REQUESTS - agreeing(self.reference[True], self.reference[False])
        print(f"(adapters change the PEFT tokens of {adapters_matter} of {REQUESTS} requests)")
        out = {}
        for t in threads:
            c = str(t)
            at = {name: per[c] for name, per in med.items() if c in per}
            procs = t if t > 1 and not self.args.no_multiprocess else 1
            rounds = {name: per[c] for name, per in self.rates.items() if c in per}
            out[c] = ratios(at, self.args.precisions, procs, self.args.quantizations, rounds)
            cpu_at = {name: median(per[c]) for name, per in self.cpu_rates.items() if c in per}
            by_cpu = ratios(cpu_at, self.args.precisions, procs, self.args.quantizations)
            for key, e in out[c].items():
                e["cpu_ratio"] = by_cpu[key]["ratio"]
                print(
                    f"  {t}t {key} = {e['ratio']:.2f} (target {e['target']}; {e['ours']} against {e['against']}; "
                    f"median of the rounds' own ratios {e['round_ratio']:.2f}; by CPU time {e['cpu_ratio']:.2f})"
                )
        return {
            "shape": shape,
            "tokens_per_s": med,
            "rates_per_round": self.rates,
            "cpu_tokens_per_s": {name: {c: median(v) for c, v in per.items()} for name, per in self.cpu_rates.items()},
            "cpu_rates_per_round": self.cpu_rates,
            "agreeing_requests": self.agree,
            "adapters_change_tokens": adapters_matter,
            "llamacpp_settings": self.used,
            "best_settings": self.best,
            "sweep": self.sweeps,
            "ratios": out,
            "targets_met": all(met(r) for r in out.values()),
            "convert_s": self.convert_s,
        }


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--llamacpp-python",
        default=os.environ.get("LORAPAGE_LLAMACPP_PYTHON"),
        help="an interpreter with llama-cpp-python (default: $LORAPAGE_LLAMACPP_PYTHON)",
    )
    p.add_argument(
        "--llama-cpp",
        type=Path,
        help="llama.cpp source with its converters, or the llama-cpp-python sdist (.tar.gz); default: the "
        "worker's version's sdist, fetched once with pip download",
    )
    p.add_argument("--sizes", default="bench,user", help=f"models, comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--precisions", default="f32,q8_0", help=f"of {', '.join(PRECISIONS)}, comma-separated")
    p.add_argument(
        "--quantizations",
        default=",".join(Q8_OURS),
        help=f"lorapage's quantized bases run against llama.cpp's Q8_0, of {', '.join(Q8_OURS)}, comma-separated",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--sweep-rounds", type=int, default=1)
    p.add_argument("--new", type=int, default=NEW, help=f"greedy tokens a request (at most {NEW})")
    p.add_argument("--sweep-tokens", type=int, default=NEW, help="greedy tokens a request in the sweep")
    p.add_argument("--fa", default="auto,off", help="llama.cpp flash attention values swept (auto, on, off)")
    p.add_argument("--kv", default="f16,f32", help="llama.cpp KV cache types swept")
    p.add_argument("--ubatch", default="32,512", help="llama.cpp n_ubatch values swept")
    p.add_argument(
        "--llamacpp-env",
        action="append",
        default=[],
        metavar="VAR=VALUE",
        help="an environment variable for llama.cpp's processes (repeatable), e.g. GOMP_SPINCOUNT=3000000",
    )
    p.add_argument("--no-multiprocess", action="store_true", help="no one-process-per-core runs (of either engine)")
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=8,
        help="lorapage's multi-step decode (EngineConfig.num_scheduler_steps): decode steps a plan runs back to back",
    )
    p.add_argument(
        "--keep",
        type=Path,
        help="a directory for the models, adapters, GGUF files and reference tokens, reused by later runs "
        "(default: a temporary one)",
    )
    p.add_argument(
        "--prepare", action="store_true", help="only write the files into --keep (no llama-cpp-python needed)"
    )
    p.add_argument("--settings", type=Path, help="a JSON line of an earlier run: its best settings, no sweep")
    p.add_argument("--quick", action="store_true", help="the bench model, f32, one round, no sweep (a smoke run)")
    args = p.parse_args()
    if args.prepare and not (args.keep and args.llama_cpp):
        p.error("--prepare writes into --keep, with the converters of --llama-cpp")
    if not args.llamacpp_python and not args.prepare:
        p.error("give --llamacpp-python (or set LORAPAGE_LLAMACPP_PYTHON): an interpreter with llama-cpp-python")
    if args.quick:
        args.sizes, args.precisions, args.rounds, args.fa, args.kv, args.ubatch = (
            "bench",
            "f32",
            1,
            "auto",
            "f16",
            "512",
        )
    args.sizes = args.sizes.split(",")
    args.precisions = args.precisions.split(",")
    args.quantizations = args.quantizations.split(",")
    args.threads = [int(t) for t in args.threads.split(",")]
    args.fa, args.kv = args.fa.split(","), args.kv.split(",")
    args.ubatch = [int(u) for u in args.ubatch.split(",")]
    unknown = (set(args.sizes) - set(SIZES)) | (set(args.precisions) - set(PRECISIONS))
    unknown |= set(args.quantizations) - set(Q8_OURS)
    if unknown:
        p.error(f"unknown size or precision: {', '.join(sorted(unknown))}")
    args.llama_env = {**os.environ, **dict(kv.split("=", 1) for kv in args.llamacpp_env)}
    args.fixed = {}
    if args.settings:
        earlier = json.loads(args.settings.read_text().strip().splitlines()[-1])
        args.fixed = {size: r["best_settings"] for size, r in earlier["models"].items()}
    return args


def main() -> None:
    args = parse()
    load_start = os.getloadavg()
    models = {}
    with tempfile.TemporaryDirectory(prefix="lorapage-peers-") as tmp:
        files = args.keep or Path(tmp)
        llama = {"version": "-", "system": "-"}
        if not args.prepare:
            probe = Worker([args.llamacpp_python, str(HERE / "llamacpp_peer.py")], Path(tmp) / "probe.log")
            try:
                llama = probe.ask(op="version")
            finally:
                probe.close()
            print(f"llama-cpp-python {llama['version']}: {llama['system']}", flush=True)
        tree = converter_dir(args.llama_cpp, llama["version"])
        benches = [Bench(args, files / size, size, tree) for size in args.sizes]
        if args.prepare:
            print(f"the models, GGUF files and reference tokens are in {files}")
            return
        for bench in benches:
            for t in sorted(args.threads):  # 1 first: its best settings are the per-core processes'
                bench.measure(t)
                if args.keep:  # what a run stopped later still leaves
                    (bench.root / "rates.json").write_text(json.dumps({"rates": bench.rates, "agree": bench.agree}))
            models[bench.size] = bench.report(args.threads)
    print(machine_line())
    print_json(
        {
            "bench": "llamacpp",
            "sizes": args.sizes,
            "threads": args.threads,
            "precisions": args.precisions,
            "quantizations": args.quantizations,
            "rounds": args.rounds,
            "requests": REQUESTS,
            "new_tokens": args.new,
            "num_scheduler_steps": args.num_scheduler_steps,
            "sweep_tokens": args.sweep_tokens,
            "llamacpp": llama,
            "models": models,
            "targets": {
                "mixed_over_llamacpp_best_mixed": ">=2.0 (same weight precision)",
                "base_over_llamacpp_base": ">=1.0 (same weight precision)",
            },
            "targets_met": all(m["targets_met"] for m in models.values()),
            "load_average": {"start": load_start, "end": os.getloadavg()},
            **machine_info(),
        }
    )


if __name__ == "__main__":
    main()

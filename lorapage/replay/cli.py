"""``lorapage replay``: make traces, replay them against a server or the embedded engine, report.

lorapage replay gen -o trace.jsonl --scale 0.05 --duration 60
lorapage replay import azure AzureLLMInferenceTrace_conv.csv -o azure.jsonl --adapters 500
lorapage replay run trace.jsonl --url http://127.0.0.1:8000 --keys keys.json --out runs/a
lorapage replay run trace.jsonl --embedded --max-loras 8 --out runs/b
lorapage replay run trace.jsonl --simulate --replicas 26 --router affinity,random --find-replicas 40
lorapage replay compare runs/a runs/b
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import signal
import sys
from collections import Counter
from dataclasses import fields
from pathlib import Path

from lorapage.flags import HelpFormatter, parser
from lorapage.heap import gc_heap_frozen
from lorapage.replay.driver import RunOptions, Target, replay
from lorapage.replay.generator import GenConfig, generate
from lorapage.replay.importers import IMPORTERS, ImportOptions
from lorapage.replay.keys import Keys, KeysError
from lorapage.replay.report import build_report, write_report
from lorapage.traces.stats import Slo
from lorapage.traces.trace import TraceError, TraceRequest, read_trace, write_trace

# gen's flags: (flag, GenConfig field, type, help). Defaults are GenConfig's.
_GEN_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--seed", "seed", int, "random seed: the same seed and options give the same trace"),
    ("--scale", "scale", float, "multiplies --rate and --adapters (the seed workload scaled down)"),
    ("--rate", "rate", float, "mean requests per second"),
    ("--duration", "duration_s", float, "seconds of trace (or --requests)"),
    ("--requests", "num_requests", int, "number of requests (instead of --duration)"),
    ("--cv", "cv", float, "coefficient of variation of inter-arrival gaps: 1 Poisson, > 1 bursty (Gamma)"),
    ("--diurnal-amplitude", "diurnal_amplitude", float, "A in rate * (1 - A cos(2 pi t / P)); 0: flat"),
    ("--diurnal-period", "diurnal_period_s", float, "P, seconds"),
    ("--adapters", "adapters", int, "number of adapters (before --scale); 0: base model only"),
    ("--zipf", "zipf_alpha", float, "Zipf exponent of adapter popularity"),
    ("--tenants", "tenants", int, "number of tenants owning the adapters"),
    ("--tenant-alpha", "tenant_alpha", float, "Zipf exponent of tenant traffic shares (without --tenant-weights)"),
    ("--base-fraction", "base_fraction", float, "fraction of requests to the base model alone"),
    ("--base-name", "base_name", str, "the base model's name on the target"),
    ("--prompt-mean", "prompt_mean", float, "mean prompt tokens (log-normal)"),
    ("--prompt-sigma", "prompt_sigma", float, "sigma of the prompt log-normal"),
    ("--prompt-max", "prompt_max", int, "prompt tokens at most (before a system prompt)"),
    ("--output-mean", "output_mean", float, "mean output tokens (log-normal); sets max_tokens"),
    ("--output-sigma", "output_sigma", float, "sigma of the output log-normal"),
    ("--output-max", "output_max", int, "output tokens at most"),
    ("--shared-fraction", "shared_fraction", float, "fraction of requests starting with a shared system prompt"),
    ("--system-prompt-len", "system_prompt_len", int, "tokens of each shared system prompt"),
    ("--system-prompts-per-tenant", "system_prompts_per_tenant", int, "shared system prompts per tenant"),
    ("--temperature", "temperature", float, "sampling temperature of every request (default: the server's)"),
)


def _gen_parser(sub) -> None:
    p = sub.add_parser(
        "gen", help="write a seeded synthetic trace", description=_doc("generator"), formatter_class=HelpFormatter
    )
    p.add_argument("-o", "--output", required=True, help="trace JSONL to write")
    defaults = {f.name: f.default for f in fields(GenConfig)}
    for flag, name, kind, text in _GEN_FLAGS:
        p.add_argument(flag, dest=name, type=kind, default=defaults[name], help=text)
    p.add_argument("--tenant-weights", default=None, help="comma-separated traffic weights, one per tenant")


def _import_parser(sub) -> None:
    p = sub.add_parser(
        "import", help="convert a public trace CSV", description=_doc("importers"), formatter_class=HelpFormatter
    )
    p.add_argument("format", choices=sorted(IMPORTERS), help="the CSV's format")
    p.add_argument("csv", help="the trace CSV to convert")
    p.add_argument("-o", "--output", required=True, help="trace JSONL to write")
    d = ImportOptions()
    p.add_argument("--seed", type=int, default=d.seed, help="random seed of the adapter and tenant draws")
    p.add_argument("--adapters", type=int, default=d.adapters, help="adapters to spread rows over (Zipf)")
    p.add_argument("--zipf", dest="zipf_alpha", type=float, default=d.zipf_alpha, help="Zipf exponent over adapters")
    p.add_argument("--tenants", type=int, default=d.tenants, help="number of tenants owning the adapters")
    p.add_argument(
        "--base-fraction", type=float, default=d.base_fraction, help="fraction of rows sent to the base model alone"
    )
    p.add_argument("--base-name", default=d.base_name, help="the base model's name on the target")
    p.add_argument("--start", dest="start_s", type=float, default=0.0, help="skip the first seconds of the trace")
    p.add_argument("--duration", dest="duration_s", type=float, default=None, help="keep this many seconds")
    p.add_argument("--limit", type=int, default=None, help="keep at most this many rows")
    p.add_argument("--prompt-max", type=int, default=None, help="clip prompt lengths (a small model's context)")
    p.add_argument("--output-max", type=int, default=None, help="clip output lengths")


def _run_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="replay a trace and write a report",
        description="Replay a trace against --url or --embedded; with --embedded every engine flag of "
        "`lorapage serve` (--model, --lora-modules, --max-loras, --scheduler, ...) is accepted.",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    p.add_argument("trace", help="trace JSONL (lorapage replay gen or import)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="an OpenAI-compatible server's root, e.g. http://127.0.0.1:8000")
    where.add_argument("--embedded", action="store_true", help="run the engine in this process")
    where.add_argument(
        "--simulate",
        action="store_true",
        help="run the fleet simulator (virtual clock, GPU cost model) instead of a server; engine flags "
        "--max-loras, --max-cpu-loras, --max-num-seqs, --max-num-batched-tokens, --scheduler size each replica; "
        "--tensor-parallel-size puts it on that many devices",
    )
    p.add_argument("--keys", help='keys file: JSON or TOML {"tenants": {tenant: key, "*": key}, "admin": key}')
    p.add_argument("--admin-key", help="key for /metrics (lorapage: the admin key or a [metrics] key)")
    p.add_argument("--out", help="report directory (default runs/<trace>-<time>)")
    p.add_argument("--speed", type=float, default=1.0, help="replay this many times faster than the trace")
    p.add_argument("--concurrency", type=int, default=None, help="closed loop with N in flight (default: open loop)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT target of resident adapters (s)")
    p.add_argument("--slo-ttft-cold", type=float, default=2.0, help="TTFT target when the adapter was not resident")
    p.add_argument("--tenants", help="tenants TOML: weights for the fairness report (embedded: also VTC shares)")
    p.add_argument("--bin", type=float, default=None, help="timeline bin width in seconds (default: about 60 bins)")
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between queue-depth samples; 0: none")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body (--url)")
    p.add_argument("--token-range", default="32:127", help="LO:HI ids for prompts given by length")
    p.add_argument(
        "--embedded-adapters",
        nargs="+",
        default=[],
        metavar="DIR",
        help="register every adapter the trace names and the engine lacks, on these directories in turn",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="write the report without plots")
    sim = p.add_argument_group("--simulate")
    sim.add_argument("--replicas", type=int, default=26, help="replicas in the simulated fleet")
    sim.add_argument(
        "--router",
        default="affinity_load,affinity,ray_default,least_loaded,random",
        help="comma-separated routing policies to compare (affinity_load, affinity, ray_default, least_loaded, random)",
    )
    sim.add_argument("--warmup", type=float, default=0.0, help="seconds of trace run but left out of the figures")
    sim.add_argument("--max-disk-loras", type=int, default=1000, help="adapters each replica's disk cache holds")
    sim.add_argument(
        "--find-replicas", type=int, default=0, help="also find the fewest replicas (up to N) meeting the SLO"
    )
    sim.add_argument("--seed", type=int, default=0, help="seed of the randomised routers")


def _compare_parser(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="two runs side by side, TTFT CDFs overlaid",
        description="Two runs' reports side by side, TTFT CDFs overlaid.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("a", help="the first run's report directory")
    p.add_argument("b", help="the second run's report directory")
    p.add_argument("--plot", default="compare_ttft_cdf.png", help="where to write the overlay ('' for none)")


def _doc(module: str) -> str:
    import importlib

    doc = importlib.import_module(f"lorapage.replay.{module}").__doc__ or ""
    return doc.split("\n\n")[0]


def build_parser() -> argparse.ArgumentParser:
    p = parser("lorapage replay", __doc__, allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_gen_parser, _import_parser, _run_parser, _compare_parser):
        add(sub)
    return p


def cmd_gen(args: argparse.Namespace) -> int:
    values = {name: getattr(args, name) for _, name, _, _ in _GEN_FLAGS}
    if args.num_requests is not None:
        values["duration_s"] = None
    if args.tenant_weights:
        values["tenant_weights"] = [float(w) for w in args.tenant_weights.split(",")]
    try:
        trace = generate(GenConfig(**values))
    except ValueError as exc:
        raise SystemExit(f"lorapage replay gen: {exc}") from None
    write_trace(args.output, trace)
    _describe(args.output, trace)
    return 0


def _describe(path: str, trace: list[TraceRequest]) -> None:
    span = trace[-1].arrival_s if trace else 0.0
    models = Counter(r.model for r in trace)
    print(
        f"{path}: {len(trace)} requests over {span:.1f} s ({len(trace) / span if span else 0:.2f}/s), "
        f"{len({r.tenant for r in trace})} tenants, {len(models)} models "
        f"(most requested {models.most_common(1)[0][0] if models else '-'})"
    )


def cmd_import(args: argparse.Namespace) -> int:
    opts = ImportOptions(
        **{f.name: getattr(args, f.name) for f in fields(ImportOptions) if hasattr(args, f.name)},
    )
    try:
        got = IMPORTERS[args.format](args.csv, opts)
    except (OSError, TraceError, ValueError) as exc:
        raise SystemExit(f"lorapage replay import: {exc}") from None
    write_trace(args.output, got.requests)
    _describe(args.output, got.requests)
    skipped = ", ".join(f"{k} {v}" for k, v in got.skipped.items() if v) or "none"
    print(f"  {got.rows} rows read; skipped: {skipped}")
    return 0


def _token_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        span = (int(lo), int(hi))
    except ValueError:
        span = (0, 0)
    if not sep or not 0 <= span[0] < span[1]:
        raise SystemExit(f"lorapage replay run: --token-range takes LO:HI with 0 <= LO < HI; got {text!r}")
    return span


def _weights(path: str | None) -> dict[str, float]:
    if not path:
        return {}
    from lorapage.tenancy.tenants import TenantsConfig, TenantsConfigError

    try:
        return dict(TenantsConfig.load(path).weights())
    except (OSError, TenantsConfigError) as exc:
        raise SystemExit(f"lorapage replay run: --tenants: {exc}") from None


def _http_target(args: argparse.Namespace, trace: list[TraceRequest]) -> Target:
    from lorapage.replay.http_target import HttpTarget

    try:
        keys = Keys.load(args.keys) if args.keys else Keys()
        if args.keys:
            keys.check_covers(r.tenant for r in trace)
    except (OSError, KeysError) as exc:
        raise SystemExit(f"lorapage replay run: --keys: {exc}") from None
    if args.admin_key:
        keys = Keys(keys.tenants, args.admin_key)
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except ValueError as exc:
        raise SystemExit(f"lorapage replay run: --extra-body is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise SystemExit("lorapage replay run: --extra-body must be a JSON object")
    return HttpTarget(args.url, keys, extra_body=extra, token_range=_token_range(args.token_range))


class _Bar:
    """A tqdm bar of finished requests with live counts (ok, errors, in flight, 429, 503)."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", dynamic_ncols=True, file=sys.stderr)

    def update(self, counts: Counter[str]) -> None:
        if counts["done"] > self.bar.n:
            self.bar.update(counts["done"] - self.bar.n)
        errors = counts["done"] - counts["ok"]
        self.bar.set_postfix_str(
            f"ok {counts['ok']} err {errors} in flight {counts['sent'] - counts['done']} "
            f"429 {counts['429']} 503 {counts['503']}",
            refresh=False,
        )


def _progress(args: argparse.Namespace, total: int) -> _Bar | None:
    if args.no_progress or not sys.stderr.isatty():
        return None
    try:
        return _Bar(total)
    except ImportError:
        return None


async def _run(args: argparse.Namespace, trace: list[TraceRequest], engine_argv: list[str]) -> Path:
    engine = None
    if args.embedded:
        from lorapage.replay.embedded import EmbeddedTarget
        from lorapage.replay.engine_flags import build_engine

        engine = build_engine(engine_argv, trace, args.embedded_adapters, _weights(args.tenants))
        target: Target = EmbeddedTarget(engine, token_range=_token_range(args.token_range))
    else:
        target = _http_target(args, trace)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def interrupted() -> None:
        print("\nlorapage replay: interrupted; writing the partial report (Ctrl-C again to abort)", file=sys.stderr)
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    loop.add_signal_handler(signal.SIGINT, interrupted)
    where = "the embedded engine" if args.embedded else args.url
    print(f"lorapage replay: {len(trace)} requests to {where} (Ctrl-C writes the partial report)", file=sys.stderr)
    sys.stderr.flush()
    progress = _progress(args, len(trace))
    opts = RunOptions(
        speed=args.speed,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        probe_interval_s=args.probe_interval or None,
    )
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    await target.start()
    # The embedded engine's startup heap out of the oldest generation's collections, as
    # `lorapage serve` once started (lorapage/heap.py).
    frozen = gc_heap_frozen() if engine is not None else contextlib.nullcontext()
    try:
        with frozen:
            result = await replay(trace, target, opts, stop=stop, progress=progress)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if progress is not None:
            progress.bar.close()
        await target.close()
        if engine is not None:
            await engine.close()
    meta = {
        "trace": args.trace,
        "target": target.describe(),
        "started": started,
        "speed": args.speed,
        "concurrency": args.concurrency,
        "mode": "closed" if args.concurrency else "open",
    }
    slo = Slo(ttft_s=args.slo_ttft, ttft_cold_s=args.slo_ttft_cold)
    report = build_report(trace, result, meta=meta, slo=slo, weights=_weights(args.tenants), bin_s=args.bin)
    out = args.out or f"runs/{Path(args.trace).stem}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    return write_report(out, result.records, report, plots=not args.no_plots)


def cmd_simulate(args: argparse.Namespace, trace: list[TraceRequest], rest: list[str]) -> int:
    from lorapage.sim.cli import run_simulation

    out = args.out or f"runs/{Path(args.trace).stem}-sim-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    slo = Slo(ttft_s=args.slo_ttft, ttft_cold_s=args.slo_ttft_cold, cold_tiers=("ram", "disk", "remote"))
    print(run_simulation(args, trace, rest, slo, Path(out)))
    return 0


def cmd_run(args: argparse.Namespace, rest: list[str]) -> int:
    if args.simulate:
        try:
            trace = read_trace(args.trace, args.limit)
        except (OSError, TraceError) as exc:
            raise SystemExit(f"lorapage replay run: {exc}") from None
        return cmd_simulate(args, trace, rest)
    if rest and not args.embedded:
        raise SystemExit(
            f"lorapage replay run: unrecognized arguments: {' '.join(rest)} (engine flags need --embedded)"
        )
    try:
        trace = read_trace(args.trace, args.limit)
    except (OSError, TraceError) as exc:
        raise SystemExit(f"lorapage replay run: {exc}") from None
    out = asyncio.run(_run(args, trace, rest))
    report = json.loads((out / "report.json").read_text())
    ttft = report["latency"]["overall"]["ttft"]
    st = report["statuses"]["by_status"]
    p95 = "-" if ttft["p95"] is None else f"{ttft['p95'] * 1000:.0f} ms"
    print(
        f"lorapage replay: {report['meta']['requests']} requests, 200: {st['200']}, 429: {st['429']}, "
        f"503: {st['503']}, other: {st['other']}, no answer: {st['none']}; TTFT p95 {p95}; report in {out}/report.md"
    )
    return 130 if report["meta"]["interrupted"] else 0


def cmd_compare(args: argparse.Namespace) -> int:
    from lorapage.replay.compare import compare

    try:
        print(compare(args.a, args.b, args.plot or None))
    except (OSError, KeyError, ValueError) as exc:
        raise SystemExit(f"lorapage replay compare: {exc}") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "run":
        return cmd_run(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"gen": cmd_gen, "import": cmd_import, "compare": cmd_compare}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

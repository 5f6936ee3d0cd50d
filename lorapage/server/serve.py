"""``lorapage serve``: the OpenAI-compatible server, with vLLM-familiar option names.

With no arguments it serves the built-in tiny model and its demo adapters on 127.0.0.1:8000 to
one ``demo`` tenant whose key (and an admin key) it prints; both keys are new on every start.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from lorapage.config import EngineConfig
from lorapage.errors import LorapageError
from lorapage.server.app import DEFAULT_MAX_BODY_BYTES, create_app, reload_tenants
from lorapage.server.auth import Access
from lorapage.server.run import serve_until_signal
from lorapage.tenants import TenantsConfigError
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

log = logging.getLogger("lorapage.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorapage serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the built-in tiny model)")
    p.add_argument("--tenants", default=None, help="tenants TOML file (default: one demo tenant, printed key)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="adapters to register at start (default with no --model: the demo adapters)",
    )
    for name, kind in (
        ("max-loras", int),
        ("max-lora-rank", int),
        ("max-cpu-loras", int),
        ("max-num-seqs", int),
        ("max-model-len", int),
        ("max-queue-len", int),
        ("max-num-batched-tokens", int),
        ("block-size", int),
        ("num-pages", int),
        ("gpu-memory-utilization", float),
        ("adapter-wait-s", float),
    ):
        p.add_argument(f"--{name}", type=kind, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--scheduler", choices=("fcfs", "vtc"), default=None)
    p.add_argument("--kernel-backend", choices=("auto", "torch", "triton"), default=None)
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA-graph capture of decode steps")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish after SIGTERM before they are aborted",
    )
    return p


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    names = (
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
        "max_num_seqs",
        "max_model_len",
        "max_queue_len",
        "max_num_batched_tokens",
        "block_size",
        "num_pages",
        "gpu_memory_utilization",
        "adapter_wait_s",
        "dtype",
        "device",
        "scheduler",
        "kernel_backend",
        "enforce_eager",
    )
    overrides = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    try:
        return EngineConfig(model=str(Path(args.model or TINY_BASE_DIR)), **overrides)
    except ValueError as exc:  # a bad flag value: say which, not a traceback
        raise SystemExit(f"lorapage serve: {exc}") from None


def _lora_modules(args: argparse.Namespace) -> dict[str, str]:
    if not args.lora_modules and args.model is None:
        return {name: str(path) for name, path in demo_adapter_dirs().items()}
    modules = {}
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"lorapage serve: --lora-modules takes NAME=DIR; got {item!r}")
        modules[name] = path
    return modules


def _access(args: argparse.Namespace, adapters: list[str]) -> Access:
    if args.tenants:
        return Access.from_file(args.tenants)
    access, tenant_key, admin_key = Access.demo(adapters)
    print(f"lorapage: demo tenant key: {tenant_key}")
    print(f"lorapage: admin key:       {admin_key}")
    return access


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    modules = _lora_modules(args)
    try:
        access = _access(args, list(modules))
    except (OSError, TenantsConfigError) as exc:
        print(f"lorapage serve: tenants file: {exc}", file=sys.stderr)
        return 2
    from lorapage.engine import Engine  # heavy (torch): after argument errors are reported

    engine = Engine(_engine_config(args))
    try:
        for name, path in modules.items():
            engine.add_adapter(name, path)
    except LorapageError as exc:
        print(f"lorapage serve: adapter {name!r}: {exc.message}", file=sys.stderr)
        return 2
    unusable = [m for m in modules if not any(access.may_use(t, m) for t in access.tenants.tenants)]
    if unusable:
        log.warning("no tenant may use %s; check the tenants file", ", ".join(unusable))
    app = create_app(engine, access, max_body_bytes=args.max_body_bytes, shutdown_grace_s=args.shutdown_timeout)
    print(f"lorapage: base model {engine.base_name!r}, adapters: {', '.join(modules) or 'none'}")

    def ready(port: int) -> None:
        print(f"lorapage: listening on http://{args.host}:{port}", flush=True)

    def reload() -> None:
        if args.tenants:
            reload_tenants(app, args.tenants)

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(serve_until_signal(app, engine, args.host, args.port, ready, on_reload=reload))
    print("lorapage: stopped", flush=True)
    return 0


def _loop_factory():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main())

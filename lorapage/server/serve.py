"""``lorapage serve``: the OpenAI-compatible server, with vLLM-familiar option names.

With no arguments it serves the built-in tiny model and its demo adapters on 127.0.0.1:8000 to
one ``demo`` tenant whose key (and an admin key) it prints; both keys are new on every start.
``--lora-modules`` directories are the operator's and are read wherever they are; adapters the
admin registers over HTTP must lie under an ``--adapter-root`` or come from an https, s3 or hf
source. Registrations, versions, aliases and owners persist in ``--state-dir`` across restarts;
``--lora-modules`` are registered again at every start (the same content is the same version).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from lorapage.config import DTYPE_NAMES, KERNEL_BACKENDS, LORA_DTYPE_NAMES, SCHEDULERS, EngineConfig
from lorapage.engine import Engine
from lorapage.errors import LorapageError
from lorapage.server.app import DEFAULT_MAX_BODY_BYTES, create_app, reload_tenants
from lorapage.server.auth import Access
from lorapage.server.run import serve_until_signal
from lorapage.server.tenants import SHARED, TenantsConfigError
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

log = logging.getLogger("lorapage.serve")

# Flags that set the EngineConfig field of the same name (dashes for underscores) when given.
_ENGINE_FLAGS: tuple[tuple[str, type], ...] = (
    ("max_loras", int),
    ("max_lora_rank", int),
    ("max_cpu_loras", int),
    ("max_num_seqs", int),
    ("max_model_len", int),
    ("max_queue_len", int),
    ("max_num_batched_tokens", int),
    ("block_size", int),
    ("num_pages", int),
    ("gpu_memory_utilization", float),
    ("adapter_wait_s", float),
    ("max_pinned_fraction", float),
    ("metrics_top_adapters", int),
    ("io_threads", int),
    ("gil_switch_interval_s", float),
)
_ENGINE_FIELDS = (
    *(name for name, _ in _ENGINE_FLAGS),
    "dtype",
    "lora_dtype",
    "device",
    "scheduler",
    "kernel_backend",
    "enforce_eager",
    "enable_chunked_prefill",
    "enable_prefix_caching",
)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model, its adapters and every EngineConfig flag: what any command that builds an
    engine takes (``lorapage serve``, ``lorapage replay run --embedded``)."""
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the built-in tiny model)")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="adapters to register at start (default with no --model: the demo adapters)",
    )
    for name, kind in _ENGINE_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None)
    p.add_argument(
        "--lora-dtype",
        choices=LORA_DTYPE_NAMES,
        default=None,
        help="adapter weights' dtype in memory (default auto: the model's; bfloat16 halves their bytes)",
    )
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--scheduler", choices=SCHEDULERS, default=None)
    p.add_argument("--kernel-backend", choices=KERNEL_BACKENDS, default=None)
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA-graph capture of decode steps")
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compute prompts longer than --max-num-batched-tokens over several steps (default: on)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse cached KV blocks of repeated prompt prefixes, per base and adapter (default: on)",
    )


def default_state_dir() -> str:
    """``$LORAPAGE_STATE_DIR``, else ``$XDG_STATE_HOME/lorapage``, else ``~/.local/state/lorapage``."""
    if env := os.environ.get("LORAPAGE_STATE_DIR"):
        return env
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(xdg) / "lorapage")


def add_state_arguments(p: argparse.ArgumentParser) -> None:
    """Where a server keeps what must survive it: the adapter registry and downloaded adapters."""
    p.add_argument(
        "--state-dir",
        default=None,
        help="the adapter registry (ids, versions, aliases, owners) lives here across restarts; "
        "':memory:' keeps it for this run only (default: $LORAPAGE_STATE_DIR, $XDG_STATE_HOME/lorapage "
        "or ~/.local/state/lorapage)",
    )
    p.add_argument(
        "--adapter-cache-dir",
        default=None,
        help="content-addressed cache of adapters downloaded from https/s3/hf (default: STATE_DIR/adapter-cache)",
    )
    p.add_argument("--adapter-cache-bytes", type=int, default=None, help="cap of that cache (default 20 GiB)")
    p.add_argument(
        "--max-adapter-download-bytes", type=int, default=None, help="cap of one adapter download (default 4 GiB)"
    )
    p.add_argument("--s3-endpoint-url", default=None, help="an S3-compatible store for s3:// sources")
    p.add_argument("--hf-endpoint", default=None, help="a Hugging Face Hub mirror for hf:// sources")


def state_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields :func:`add_state_arguments`' flags set."""
    state = args.state_dir or default_state_dir()
    out: dict[str, Any] = {"state_dir": None if state == ":memory:" else state}
    for name in (
        "adapter_cache_dir",
        "adapter_cache_bytes",
        "max_adapter_download_bytes",
        "s3_endpoint_url",
        "hf_endpoint",
    ):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorapage serve", description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    add_state_arguments(p)
    p.add_argument("--tenants", default=None, help="tenants TOML file (default: one demo tenant, printed key)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        metavar="DIR",
        help="directory under which POST /v1/adapters may read adapters (repeatable; none: HTTP registration refused)",
    )
    p.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without a key (it names every tenant; default: the admin key or a [metrics] key)",
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish after SIGTERM before they are aborted",
    )
    return p


def engine_config(args: argparse.Namespace, prog: str = "lorapage serve") -> EngineConfig:
    """The EngineConfig that :func:`add_engine_arguments`' (and, where the parser has them,
    :func:`add_state_arguments`') flags ask for; a bad value exits naming it."""
    overrides: dict[str, Any] = {n: getattr(args, n) for n in _ENGINE_FIELDS if getattr(args, n) is not None}
    if hasattr(args, "state_dir"):
        overrides.update(state_overrides(args))
    try:
        return EngineConfig(model=str(Path(args.model or TINY_BASE_DIR)), **overrides)
    except ValueError as exc:  # a bad flag value: say which, not a traceback
        raise SystemExit(f"{prog}: {exc}") from None


def lora_modules(args: argparse.Namespace, prog: str = "lorapage serve") -> dict[str, str]:
    """``--lora-modules`` as name -> directory (the demo adapters when neither it nor --model is given)."""
    if not args.lora_modules and args.model is None:
        return {name: str(path) for name, path in demo_adapter_dirs().items()}
    modules = {}
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"{prog}: --lora-modules takes NAME=DIR; got {item!r}")
        modules[name] = path
    return modules


def _access(args: argparse.Namespace, adapters: list[str]) -> Access:
    if args.tenants:
        return Access.from_file(args.tenants)
    access, tenant_key, admin_key = Access.demo(adapters)
    print(f"lorapage: demo tenant key: {tenant_key}")
    print(f"lorapage: admin key:       {admin_key}")
    return access


def _adapter_roots(args: argparse.Namespace) -> list[Path]:
    roots = [Path(r) for r in args.adapter_root]
    for root in roots:
        if not root.is_dir():
            raise SystemExit(f"lorapage serve: --adapter-root {root}: no such directory")
    return roots


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    modules = lora_modules(args)
    roots = _adapter_roots(args)
    config = engine_config(args)
    try:
        access = _access(args, list(modules))
    except (OSError, TenantsConfigError) as exc:
        print(f"lorapage serve: tenants file: {exc}", file=sys.stderr)
        return 2
    engine = Engine(config)
    try:
        for name, path in modules.items():
            engine.add_adapter(name, path)
    except LorapageError as exc:
        print(f"lorapage serve: adapter {name!r}: {exc.message}", file=sys.stderr)
        return 2
    unusable = [m for m in modules if not any(access.may_use(t, m) for t in access.tenants.tenants)]
    if unusable:
        log.warning(
            "no tenant may use %s: access fails closed; name it in a tenant's `adapters`, or give a tenant "
            '`adapters = ["%s"]` to open every adapter without an owner',
            ", ".join(unusable),
            SHARED,
        )
    app = create_app(
        engine,
        access,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace_s=args.shutdown_timeout,
        metrics_public=args.metrics_public,
        adapter_roots=roots,
    )
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

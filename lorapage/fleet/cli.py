"""``lorapage fleet``: the OpenAI API of ``lorapage serve`` over N engine replicas on Ray Serve.

With ``--address`` it joins a running Ray cluster (``ray://host:10001`` or ``auto``); without, it
starts a local Ray on this machine. The engine and server flags are those of ``lorapage serve``;
with no ``--tenants`` file it prints a new demo tenant key and admin key, as ``lorapage serve``
does. ``--state-dir`` holds the fleet's adapter registry on this machine (the ingress runs here
unless the cluster places it elsewhere). SIGHUP re-reads the tenants file and hands it to the
ingress; SIGINT or SIGTERM stops (taking the application down).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from lorapage.fleet.config import DEFAULT_MAX_BODY_BYTES, FleetConfig
from lorapage.fleet.routing import ROUTERS
from lorapage.server.serve import add_engine_arguments, add_state_arguments, engine_config, lora_modules
from lorapage.server.tenants import TenantsConfig, TenantsConfigError, hash_key

PROG = "lorapage fleet"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    add_state_arguments(p)
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (one Engine each)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start a local Ray)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per engine replica")
    p.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs Ray reserves per engine replica")
    p.add_argument("--router", choices=ROUTERS, default="affinity", help="routing policy (default: affinity)")
    p.add_argument("--owners", type=int, default=2, help="rendezvous owners per adapter (affinity)")
    p.add_argument(
        "--spill-load", type=float, default=1.0, help="owner load (fraction of max_num_seqs) past which requests spill"
    )
    p.add_argument("--tenants", default=None, help="tenants TOML file (default: one demo tenant, printed key)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        metavar="DIR",
        help="directory under which POST /v1/adapters may read adapters (repeatable; a directory every "
        "replica's node can read: shared storage on a cluster; none: directory registration refused)",
    )
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    p.add_argument(
        "--sync-period", type=float, default=1.0, help="seconds between replica heartbeats (registry, stats)"
    )
    return p


def _tenants_toml(path: str | None, adapters: list[str]) -> str:
    """The tenants file's text, checked here so a bad file fails before Ray starts; or a demo
    tenant that may use ``adapters``, whose fresh keys are printed."""
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        TenantsConfig.from_toml(text, source=path)
        return text
    import secrets

    tenant_key = f"lp-demo-{secrets.token_urlsafe(24)}"
    admin_key = f"lp-admin-{secrets.token_urlsafe(24)}"
    print(f"lorapage: demo tenant key: {tenant_key}")
    print(f"lorapage: admin key:       {admin_key}")
    return (
        f'[admin]\nkey_sha256 = ["{hash_key(admin_key)}"]\n\n'
        f'[tenants.demo]\nkey_sha256 = ["{hash_key(tenant_key)}"]\nadapters = {list(adapters)!r}\n'
    ).replace("'", '"')


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    modules = lora_modules(args, PROG)
    try:
        tenants = _tenants_toml(args.tenants, list(modules))
    except (OSError, TenantsConfigError) as exc:
        raise SystemExit(f"{PROG}: tenants file: {exc}") from None
    engine = engine_config(args, PROG)
    for root in args.adapter_root:
        if not Path(root).is_dir():
            raise SystemExit(f"{PROG}: --adapter-root {root}: no such directory")
    try:
        return FleetConfig(
            engine=engine,
            state_dir=engine.state_dir,
            adapter_roots=tuple(str(Path(r).resolve()) for r in args.adapter_root),
            metrics_public=args.metrics_public,
            sync_period_s=args.sync_period,
            tenants_toml=tenants,
            lora_modules=tuple((name, str(Path(path).resolve())) for name, path in modules.items()),
            replicas=args.replicas,
            replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus,
            router=args.router,
            owners=args.owners,
            spill_load=args.spill_load,
            max_body_bytes=args.max_body_bytes,
        )
    except ValueError as exc:
        raise SystemExit(f"{PROG}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = fleet_config(args)
    import ray
    from ray import serve

    from lorapage.fleet.app import APP_NAME, build_app

    started = time.monotonic()
    # "local": a Ray of our own, even where another one runs on this machine (ray.init(None) would join it).
    ray.init(address=args.address or "local", num_cpus=args.num_cpus, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    try:
        adapters = app.ready.remote().result()  # the --lora-modules, checked on a replica
    except Exception as exc:
        serve.delete(APP_NAME)
        raise SystemExit(f"{PROG}: --lora-modules: {exc}") from None
    print(
        f"lorapage: fleet of {config.replicas} replicas ({config.router} routing) up in "
        f"{time.monotonic() - started:.0f}s; adapters: {', '.join(adapters) or 'none'}; "
        f"listening on http://{args.host}:{args.port}",
        flush=True,
    )
    stop, reload = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def on_hup(*_: object) -> None:
        reload.set()
        stop.set()

    signal.signal(signal.SIGHUP, on_hup)
    while True:
        stop.wait()
        if not reload.is_set():
            break
        stop.clear()
        reload.clear()
        if args.tenants:
            try:
                text = Path(args.tenants).read_text(encoding="utf-8")
            except OSError as exc:
                print(f"lorapage: tenants file not reloaded, keeping the old one: {exc}", flush=True)
                continue
            print(f"lorapage: {app.reload_tenants.remote(text).result()}", flush=True)
    serve.delete(APP_NAME)
    if args.address is None:
        serve.shutdown()
        ray.shutdown()
    print("lorapage: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

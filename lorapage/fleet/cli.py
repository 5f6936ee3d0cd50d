"""``lorapage fleet``: the OpenAI API of ``lorapage serve`` over N engine replicas on Ray Serve.

With ``--address`` it joins a running Ray cluster (``ray://host:10001`` or ``auto``); without, it
starts a local Ray on this machine. The engine and server flags are those of ``lorapage serve``;
with no ``--tenants`` file it prints a new demo tenant key and admin key, as ``lorapage serve``
does (``--api-key``: one tenant whose keys are those, the admin keys too). ``--state-dir`` holds
the fleet's adapter registry on this machine (the ingress runs here unless the cluster places it
elsewhere); the ingress serves ``lorapage serve``'s front end itself on ``--host:--port`` (Ray
Serve's HTTP proxy is not started). SIGHUP re-reads the tenants file and hands it to the ingress;
SIGINT or SIGTERM stops (taking the application down).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

from lorapage.bases.serving import check_alike
from lorapage.config import FLEET_ENVELOPE, EngineConfig
from lorapage.engine.flags import (
    adapter_roots,
    add_engine_arguments,
    add_state_arguments,
    check_model_dir,
    engine_config,
    lora_modules,
)
from lorapage.flags import fail, parser
from lorapage.fleet.autoscale_flags import add_autoscale_arguments, autoscale_config
from lorapage.fleet.config import INGRESS_CPUS, MERGED_APP_PREFIX, FleetConfig, replica_cpus_for
from lorapage.fleet.dedicated_flags import add_dedicated_arguments, dedicated_config
from lorapage.fleet.routing import ROUTERS
from lorapage.fleet.start import START_TIMEOUT_S, StartError, run_app
from lorapage.frontend.flags import (
    API_KEY_TENANT,
    add_front_end_arguments,
    api_key_tenants,
    api_keys,
    check_root_tenants,
    edge_limits,
    open_access_log,
    slo_window,
)
from lorapage.frontend.run import listen
from lorapage.model.config import ModelConfig, context_length
from lorapage.model.tokenizer import Tokenizer
from lorapage.tenancy.tenants import TenantsConfig, TenantsConfigError, hash_key

PROG = "lorapage fleet"


def build_parser() -> argparse.ArgumentParser:
    p = parser(PROG, __doc__)
    add_engine_arguments(p)
    add_state_arguments(p)
    add_front_end_arguments(p)
    ray_group = p.add_argument_group("Ray")
    ray_group.add_argument("--replicas", type=int, default=2, help="engine replicas (one Engine each)")
    ray_group.add_argument(
        "--address", default=None, help="Ray cluster to join, ray://HOST:10001 or auto (default: start a local Ray)"
    )
    ray_group.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray (default: all cores)")
    ray_group.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="CPUs Ray reserves per engine replica, per rank under --tensor-parallel-size (default: 1, or what "
        f"the cluster's CPUs leave each after the ingress's {INGRESS_CPUS})",
    )
    ray_group.add_argument(
        "--replica-gpus",
        type=float,
        default=0.0,
        help="GPUs Ray reserves per engine replica, per rank under --tensor-parallel-size (a replica of K ranks: "
        "one placement group of K bundles on one node, docs/parallel.md)",
    )
    ray_group.add_argument(
        "--start-timeout",
        type=float,
        default=START_TIMEOUT_S,
        help="seconds every deployment gets to be running; past it the command exits with Ray's reason",
    )
    p.add_argument(
        "--base",
        action="append",
        default=[],
        metavar="DIR",
        help="serve this base model too, beside --model (repeatable): one more engine deployment of --replicas "
        "replicas each, with the same engine flags; a request goes to the base its adapter version is bound to",
    )
    routing = p.add_argument_group("routing")
    routing.add_argument(
        "--router",
        choices=ROUTERS,
        default="affinity_load",
        help="routing policy (default affinity_load; affinity: the older one)",
    )
    routing.add_argument(
        "--owners", type=int, default=2, help="rendezvous owners per adapter (affinity; affinity_load: the fewest)"
    )
    routing.add_argument(
        "--spill-load", type=float, default=1.0, help="owner load (fraction of max_num_seqs) past which requests spill"
    )
    routing.add_argument(
        "--sync-period", type=float, default=1.0, help="seconds between replica heartbeats (registry, stats)"
    )
    routing.add_argument(
        "--pinned-guard",
        type=float,
        default=0.8,
        help="affinity_load: a replica whose lora slots are this held (pinned, hot, in use) takes no adapter it lacks",
    )
    add_dedicated_arguments(p)
    add_autoscale_arguments(p)
    return p


def _tenants_toml(path: str | None, adapters: list[str], keys: list[str]) -> str:
    """The tenants file's text, checked here so a bad file fails before Ray starts; the single
    tenant of ``--api-key`` ``keys``; or a demo tenant that may use ``adapters``, whose fresh keys
    are printed."""
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        TenantsConfig.from_toml(text, source=path)
        return text
    if keys:
        print(f"lorapage: single tenant {API_KEY_TENANT!r}: its API key (--api-key) opens every route")
        return api_key_tenants(keys)
    import secrets

    tenant_key = f"lp-demo-{secrets.token_urlsafe(24)}"
    admin_key = f"lp-admin-{secrets.token_urlsafe(24)}"
    print(f"lorapage: demo tenant key: {tenant_key}")
    print(f"lorapage: admin key:       {admin_key}")
    return (
        f'[admin]\nkey_sha256 = ["{hash_key(admin_key)}"]\n\n'
        f'[tenants.demo]\nkey_sha256 = ["{hash_key(tenant_key)}"]\nadapters = {list(adapters)!r}\n'
    ).replace("'", '"')


def fleet_config(args: argparse.Namespace, replica_cpus: float, tenants_toml: str) -> FleetConfig:
    """The fleet the flags ask for; a bad flag ends the command naming it."""
    engine = engine_config(args, PROG)
    if engine.shared_envelope is None:  # a fleet's dedicated tier takes the wider adapters
        engine = dataclasses.replace(engine, shared_envelope=FLEET_ENVELOPE)
    modules = lora_modules(args, PROG)
    try:
        return FleetConfig(
            engine=engine,
            state_dir=engine.state_dir,
            adapter_roots=adapter_roots(args, modules, PROG).values(),
            metrics_public=args.metrics_public,
            sync_period_s=args.sync_period,
            tenants_toml=tenants_toml,
            lora_modules=tuple((name, str(Path(path).resolve())) for name, path in modules.items()),
            replicas=args.replicas,
            replica_cpus=replica_cpus,
            replica_gpus=args.replica_gpus,
            router=args.router,
            owners=args.owners,
            spill_load=args.spill_load,
            pinned_guard=args.pinned_guard,
            autoscale=autoscale_config(args, engine.max_num_seqs, PROG),
            max_body_bytes=args.max_body_bytes,
            slo_window_s=slo_window(args, PROG),
            access_log=_access_log_path(args),
            dedicated=dedicated_config(args, PROG),
            bases=_bases(args, engine),
            host=args.host,
            port=args.port,
            edge=edge_limits(args, PROG),
        )
    except ValueError as exc:
        fail(PROG, str(exc))


def _bases(args: argparse.Namespace, engine: EngineConfig) -> tuple[str, ...]:
    """``--base`` directories, checked and absolute (Ray's workers have another working directory):
    each of another directory name than the others (its deployment, ``EngineReplica-<name>``, and
    its served model are named by it), and of the primary's tokenizer and context (the ingress
    tokenizes every prompt once, before it chooses a base)."""
    for model in args.base:
        check_model_dir(model, PROG, flag="--base")
    models = [engine.model, *args.base]
    names = [Path(m).resolve().name for m in models]
    if len(set(names)) < len(names):
        fail(PROG, f"--model and each --base need directories of distinct names (a base is served by it); got {names}")
    if args.base:
        check_alike(
            [
                (
                    name,
                    Tokenizer.from_dir(m).backend.to_str(),
                    context_length(ModelConfig.from_dir(m), engine.max_model_len, engine.allow_long_max_model_len),
                )
                for name, m in zip(names, models, strict=True)
            ]
        )  # a ValueError: the caller's one line
    return tuple(str(Path(model).resolve()) for model in args.base)


def _access_log_path(args: argparse.Namespace) -> str | None:
    """``--access-log`` as the ingress opens it: ``-``, or the file's absolute path (the ingress's
    working directory is Ray's); checked here first, so a file that cannot be opened ends the command."""
    log = open_access_log(args, PROG)
    if log is None:
        return None
    log.close()
    return "-" if args.access_log == "-" else str(Path(args.access_log).resolve())


def _replica_cpus(args: argparse.Namespace, cpus: float) -> float:
    try:
        # An autoscaled fleet must fit at its largest.
        return replica_cpus_for(
            cpus, args.max_replicas or args.replicas, INGRESS_CPUS, args.replica_cpus, args.tensor_parallel_size or 1
        )
    except ValueError as exc:
        fail(PROG, str(exc))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replicas < 1:
        fail(PROG, f"--replicas must be >= 1; got {args.replicas}")
    # Everything that can be checked before Ray starts: the flags, what a local Ray would hold,
    # the port (Ray's proxy binds it later) and the tenants file.
    fleet_config(args, 1.0, "")
    if args.address is None:
        _replica_cpus(args, args.num_cpus or float(os.cpu_count() or 1))
    try:
        listen(args.host, args.port).close()
    except OSError as exc:
        fail(PROG, f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    modules = lora_modules(args, PROG)
    keys = api_keys(args, PROG)
    try:
        tenants = _tenants_toml(args.tenants, list(modules), keys)
    except (OSError, TenantsConfigError) as exc:
        fail(PROG, f"tenants file: {exc}")
    check_root_tenants(adapter_roots(args, modules, PROG), TenantsConfig.from_toml(tenants).tenants, PROG)
    import ray
    from ray import serve

    from lorapage.fleet.app import build_app

    started = time.monotonic()
    # "local": a Ray of our own, even where another one runs on this machine (ray.init(None) would join it).
    ray.init(address=args.address or "local", num_cpus=args.num_cpus, include_dashboard=False)
    config = fleet_config(args, _replica_cpus(args, float(ray.cluster_resources().get("CPU", 0.0))), tenants)
    serve.start(proxy_location="Disabled")  # the ingress serves HTTP itself (lorapage.fleet.ingress)
    try:
        app = run_app(build_app(config), config.replica_needs(), args.start_timeout)
    except StartError as exc:
        _stop(args.address, drain=False)
        fail(PROG, str(exc))
    try:
        adapters = app.ready.remote().result()  # the --lora-modules, checked on a replica
    except Exception as exc:
        _stop(args.address, drain=False)
        fail(PROG, f"--lora-modules: {exc}")
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
    _stop(args.address)
    print("lorapage: stopped", flush=True)
    return 0


def _stop(address: str | None, *, drain: bool = True) -> None:
    """Take the application down, and the local Ray with it (a joined cluster stays up); the
    promoted adapters' dedicated deployments (applications the ingress started) with it.
    ``drain=False`` (a start that failed: no request was ever taken) ends a local Ray at once
    rather than giving each replica Serve's grace period, which a replica Ray never placed spends
    in full (20 s)."""
    import ray
    from ray import serve

    from lorapage.fleet.app import APP_NAME

    if address is None and not drain:
        ray.shutdown()
        return
    serve.delete(APP_NAME)
    for name in serve.status().applications:
        if name.startswith(MERGED_APP_PREFIX):
            serve.delete(name)
    if address is None:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())

"""``lorapage serve``: the OpenAI-compatible server, with vLLM-familiar option names.

With no arguments it serves the built-in tiny model and its demo adapters on 127.0.0.1:8000 to
one ``demo`` tenant whose key (and an admin key) it prints; both keys are new on every start.
``--api-key KEY`` (vLLM's flag; repeatable, or ``$LORAPAGE_API_KEY``) is single-tenant use instead:
one tenant ``default`` whose fixed keys open every route, the admin routes included, as vLLM's
``--api-key`` guards everything; it may use every adapter without an owner.
``--lora-modules`` directories are the operator's and are read wherever they are; adapters the
admin registers over HTTP for a tenant must lie under an ``--adapter-root`` that tenant may read
from (its own ``TENANT=DIR`` ones, else the shared ones) or come from an https, s3 or hf source.
Registrations, versions, aliases and owners persist in ``--state-dir`` across restarts, which one
server at a time holds (a second one on it refuses to start); ``--lora-modules`` are registered
again at every start (the same content is the same version).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sqlite3
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from lorapage.adapters.binding import load_base_names
from lorapage.adapters.registry import REGISTRY_FILE, RegistrySchemaError
from lorapage.adapters.sources import AdapterRoots
from lorapage.adapters.state_lock import StateDirError
from lorapage.config import GROUPS, EngineConfig
from lorapage.engine import Engine
from lorapage.engine.devices import resolve_device
from lorapage.engine.merge_check import CHECK_PROMPTS, TOLERANCES, merge_and_check, read_check_prompts
from lorapage.errors import LorapageError
from lorapage.flags import add_config_flags, config_overrides, fail, parser
from lorapage.server.access_log import AccessLog
from lorapage.server.app import DEFAULT_MAX_BODY_BYTES, create_app, reload_tenants
from lorapage.server.auth import Access
from lorapage.server.edge import EdgeLimits
from lorapage.server.engine_backend import ENGINES
from lorapage.server.engines import side_config, utilization_share
from lorapage.server.registration import check_adapter_id
from lorapage.server.run import listen, serve_until_signal
from lorapage.server.slo import DEFAULT_WINDOW_S
from lorapage.server.tenants import SHARED, TenantsConfig, TenantsConfigError, hash_key
from lorapage.tiny import demo_adapter_dirs

log = logging.getLogger("lorapage.serve")
# Flags of their own below: a server keeps its registry on disk by default, an engine in memory.
_STATE_FLAG = "state_dir"
# EngineConfig fields that are where a server keeps its state (the "state" group; flags: add_state_arguments).
STATE_FIELDS = tuple(
    f.name for f in fields(EngineConfig) if f.metadata.get("group") == "state" and f.name != _STATE_FLAG
)
ENGINE_FLAG_FIELDS = tuple(f.name for f in fields(EngineConfig) if f.name != _STATE_FLAG)
PROG = "lorapage serve"
API_KEY_ENV = "LORAPAGE_API_KEY"  # vLLM reads VLLM_API_KEY
API_KEY_TENANT = "default"  # the one tenant of --api-key


def add_engine_arguments(p: argparse.ArgumentParser) -> list[str]:
    """The model, its adapters and every EngineConfig flag except the state ones: what any command
    that builds an engine takes (``lorapage serve``, ``fleet``, ``replay run --embedded``).
    Returns the config fields it made flags for."""
    names = add_config_flags(p, EngineConfig, skip=(*STATE_FIELDS, _STATE_FLAG))
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="PEFT adapter directories to register at start (default with no --model: the demo adapters)",
    )
    return names


def default_state_dir() -> str:
    """``$LORAPAGE_STATE_DIR``, else ``$XDG_STATE_HOME/lorapage``, else ``~/.local/state/lorapage``."""
    if env := os.environ.get("LORAPAGE_STATE_DIR"):
        return env
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(xdg) / "lorapage")


def add_state_arguments(p: argparse.ArgumentParser) -> list[str]:
    """Where a server keeps what must survive it: the adapter registry and downloaded adapters."""
    group = p.add_argument_group(GROUPS["state"])
    group.add_argument(
        "--state-dir",
        default=None,
        help="the adapter registry (ids, versions, aliases, owners) lives here across restarts; "
        "':memory:' keeps it for this run only (default: $LORAPAGE_STATE_DIR, $XDG_STATE_HOME/lorapage "
        "or ~/.local/state/lorapage)",
    )
    return add_config_flags(p, EngineConfig, only=STATE_FIELDS)


def add_front_end_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP front end's flags, shared by ``lorapage serve`` and ``lorapage fleet`` (the request
    log, the SLO window and the connection-level bounds included: the fleet's ingress serves the
    same aiohttp front end)."""
    group = p.add_argument_group("HTTP front end")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    group.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="tenants TOML file: keys, quotas, weights, adapters (default: one demo tenant whose new key is printed)",
    )
    group.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help=f"single-tenant use, as vLLM's flag: with no --tenants, one tenant {API_KEY_TENANT!r} whose keys are "
        "these (repeatable); it may use every adapter without an owner, and its key is the admin key too (it "
        "opens every route, /metrics and the admin routes included). Default: $LORAPAGE_API_KEY (one key)",
    )
    group.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        metavar="[TENANT=]DIR",
        help="directory under which POST /v1/adapters may read adapters (repeatable; a directory every replica "
        "can read on a cluster). TENANT=DIR: that tenant's own, and then its only ones; DIR: shared, for tenants "
        "with none of their own. No entry may link outside or into another tenant's (default: none, and HTTP "
        "registration from directories is refused)",
    )
    group.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without a key (it names every tenant; default: the admin key or a [metrics] key)",
    )
    group.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="largest request body accepted (413 past it)"
    )
    group.add_argument(
        "--access-log",
        metavar="FILE|-",
        help="one JSON line per answered request (request id, tenant, adapter@version, tier, tokens, TTFT, "
        "end-to-end, status; never prompt text or keys), appended to FILE or written to standard output "
        "(default: none; in a fleet the ingress writes it, on its node)",
    )
    group.add_argument(
        "--slo-window",
        type=float,
        default=DEFAULT_WINDOW_S,
        metavar="SECONDS",
        help="sliding window of each tenant's goodput, error-ratio and SLO burn-rate gauges on /metrics (the "
        "tenants file's slo_* fields set the targets)",
    )
    defaults = EdgeLimits()
    group.add_argument(
        "--header-timeout",
        type=float,
        default=defaults.header_timeout_s,
        metavar="SECONDS",
        help="a connection that has not sent a whole request's headers this long after it opened (or after its "
        "previous answer) is closed; idle keep-alive connections close after it too",
    )
    group.add_argument(
        "--max-connections-per-ip",
        type=int,
        default=defaults.max_connections_per_ip,
        metavar="N",
        help="connections one client address may hold at once; more are answered 429 and closed (0: no cap; "
        "behind a proxy every client has the proxy's address)",
    )


def edge_limits(args: argparse.Namespace, prog: str = PROG) -> EdgeLimits:
    """``--header-timeout`` and ``--max-connections-per-ip``, checked."""
    if not args.header_timeout > 0 or args.max_connections_per_ip < 0:
        fail(prog, "--header-timeout must be > 0 seconds and --max-connections-per-ip >= 0 (0: no cap)")
    return EdgeLimits(args.header_timeout, args.max_connections_per_ip)


def api_keys(args: argparse.Namespace, prog: str = PROG) -> list[str]:
    """``--api-key`` values, else ``$LORAPAGE_API_KEY`` (none: []); refused beside ``--tenants``."""
    keys = args.api_key or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])
    source = "--api-key" if args.api_key else f"${API_KEY_ENV}"
    if keys and args.tenants:
        fail(prog, f"{source} is for single-tenant use; with --tenants, give the keys in the tenants file")
    if any(not key or any(c.isspace() for c in key) for key in keys):
        fail(prog, f"{source}: a key must be non-empty text without spaces (clients send it as 'Bearer KEY')")
    return keys


def api_key_tenants(keys: list[str]) -> str:
    """The tenants file of single-tenant use: one tenant, :data:`API_KEY_TENANT`, authenticated by
    ``keys``, which are the admin keys too; it may use every adapter without an owner and register
    from any bucket or Hub organisation (the operator is the only user)."""
    digests = ", ".join(f'"{hash_key(k)}"' for k in keys)
    return (
        f'[admin]\nkey_sha256 = [{digests}]\ntenant = "{API_KEY_TENANT}"\n\n'
        f'[tenants.{API_KEY_TENANT}]\nadapters = ["{SHARED}"]\ns3_buckets = ["{SHARED}"]\nhf_orgs = ["{SHARED}"]\n'
    )


def state_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields :func:`add_state_arguments`' flags set."""
    state = args.state_dir or default_state_dir()
    return {"state_dir": None if state == ":memory:" else state, **config_overrides(args, STATE_FIELDS)}


def build_parser() -> argparse.ArgumentParser:
    p = parser(PROG, __doc__)
    add_engine_arguments(p)
    add_state_arguments(p)
    add_front_end_arguments(p)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish after SIGTERM before they are aborted",
    )
    add_merge_arguments(p)
    p.add_argument(
        "--base",
        action="append",
        default=[],
        metavar="DIR",
        help="serve this base model too, beside --model (repeatable): each base its own engine, with the same engine "
        "flags (memory flags apply per engine; on one CUDA device the engines share --gpu-memory-utilization); "
        "a request runs on the base its adapter version is bound to, or the "
        "base its model names; --model stays the primary: its registry in --state-dir is the server's, and unbound "
        "adapters (--allow-unbound) and --lora-modules are its",
    )
    return p


def slo_window(args: argparse.Namespace, prog: str = PROG) -> float:
    """``--slo-window``, checked (the command ends naming it when it is not a number of seconds > 0)."""
    if not 0 < args.slo_window < float("inf"):
        fail(prog, f"--slo-window must be a number of seconds > 0, got {args.slo_window}")
    return float(args.slo_window)


def open_access_log(args: argparse.Namespace, prog: str = PROG) -> AccessLog | None:
    """``--access-log`` opened (None without it); the command ends naming it when it cannot be."""
    try:
        return AccessLog(args.access_log) if args.access_log else None
    except OSError as exc:
        fail(prog, f"--access-log {args.access_log}: {exc.strerror or exc}")


def add_merge_arguments(p: argparse.ArgumentParser) -> None:
    """The dedicated tier on one machine: one adapter merged into the base weights."""
    group = p.add_argument_group("dedicated deployment (one adapter merged into the base)")
    group.add_argument(
        "--merge",
        metavar="ADAPTER[=DIR]",
        help="serve only this adapter, merged into the base weights (no LoRA path; the shared envelope does not "
        "apply): requests name it as their model, and the base and every other adapter are refused 404. DIR "
        "registers it from a PEFT directory; without one it must be among --lora-modules or the registry. Before "
        "listening, greedy tokens and logprobs on stored prompts are checked against the unmerged LoRA path, and "
        "the server does not start if they differ (default: none, the shared pool)",
    )
    group.add_argument(
        "--merge-check-prompts",
        metavar="FILE",
        help='more prompts for the --merge check, one per line (a JSON string or {"prompt": TEXT}), beside the '
        f"{len(CHECK_PROMPTS)} built-in ones (default: the built-in ones only)",
    )
    group.add_argument(
        "--merge-check-tolerance",
        type=float,
        metavar="LOGPROB",
        help="the --merge check's bound on |d logprob| of a chosen token, and on the gap of a near-tie (default: "
        + ", ".join(f"{v:g} in {k}" for k, v in TOLERANCES.items())
        + ")",
    )


def merge_target(args: argparse.Namespace, modules: dict[str, str], prog: str = PROG) -> str | None:
    """``--merge``'s adapter name; ``modules`` (what is registered at start) is cut down to it,
    from its ``DIR`` or its ``--lora-modules`` entry (neither: it must be in the registry)."""
    if args.merge is None:
        if args.merge_check_prompts or args.merge_check_tolerance is not None:
            fail(prog, "--merge-check-prompts and --merge-check-tolerance are for --merge")
        return None
    name, sep, path = args.merge.partition("=")
    try:
        check_adapter_id(name, base_name="")
    except LorapageError as exc:
        fail(prog, f"--merge {args.merge}: {exc.message}")
    if sep and not path:
        fail(prog, f"--merge takes ADAPTER or ADAPTER=DIR; got {args.merge!r}")
    if args.merge_check_tolerance is not None and not 0 <= args.merge_check_tolerance < float("inf"):
        fail(prog, f"--merge-check-tolerance must be a number >= 0; got {args.merge_check_tolerance}")
    path = path or modules.get(name, "")
    if args.lora_modules and set(modules) - {name}:
        log.warning("--merge %s: the other --lora-modules are not registered (this server serves %s alone)", name, name)
    modules.clear()
    if path:
        modules[name] = path
    return name


def merge_check_prompts(args: argparse.Namespace, prog: str = PROG) -> list[str]:
    """The ``--merge`` check's prompts: the built-in ones and ``--merge-check-prompts``' (read
    before the model loads, so a bad file ends the command at once)."""
    prompts = list(CHECK_PROMPTS)
    if args.merge_check_prompts:
        try:
            prompts += read_check_prompts(args.merge_check_prompts)
        except (OSError, ValueError) as exc:
            fail(prog, f"--merge-check-prompts {exc}")
    return prompts


def run_merge_check(
    runner: asyncio.Runner, engine: Engine, name: str, prompts: list[str], tolerance: float | None
) -> None:
    """Merge ``name`` into ``engine`` and check it (:mod:`lorapage.engine.merge_check`); a failed
    check ends the command with its numbers before anything listens."""
    try:
        check = runner.run(merge_and_check(engine, name, prompts, tolerance=tolerance))
    except LorapageError as exc:
        runner.run(engine.close())
        fail(PROG, f"--merge {name}: {exc.message}")
    if not check.passed:
        runner.run(engine.close())
        fail(PROG, f"--merge {name}: {check.line()}; not serving a merge that differs from the adapter")
    log.info("%s", check.line())


def engine_config(args: argparse.Namespace, prog: str = PROG) -> EngineConfig:
    """The EngineConfig that :func:`add_engine_arguments`' (and, where the parser has them,
    :func:`add_state_arguments`') flags ask for; a bad value ends the command naming it."""
    overrides = config_overrides(args, ENGINE_FLAG_FIELDS)
    if hasattr(args, _STATE_FLAG):
        overrides.update(state_overrides(args))
    try:
        config = EngineConfig(**overrides)
    except ValueError as exc:  # a bad flag value: say which, not a traceback
        fail(prog, str(exc))
    check_model_dir(config.model, prog)
    if config.base_names is not None:
        try:
            load_base_names(config.base_names)
        except ValueError as exc:
            fail(prog, f"--base-names {config.base_names}: {exc}")
    return config


def check_model_dir(model: str, prog: str = PROG, flag: str = "--model") -> None:
    """End ``prog`` with one line (naming ``flag``) when ``model`` is no readable Hugging Face model directory."""
    config = Path(model) / "config.json"
    try:
        with config.open("rb"):
            pass
    except OSError as exc:
        reason = "no such directory" if not Path(model).is_dir() else f"cannot read config.json ({exc.strerror})"
        fail(prog, f"{flag} {model}: {reason}; expected a Hugging Face model directory (config.json, *.safetensors)")


def lora_modules(args: argparse.Namespace, prog: str = PROG) -> dict[str, str]:
    """``--lora-modules`` as name -> directory (the demo adapters when neither it nor --model is given)."""
    if not args.lora_modules and args.model is None:
        return {name: str(path) for name, path in demo_adapter_dirs().items()}
    modules = {}
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            fail(prog, f"--lora-modules takes NAME=DIR; got {item!r}")
        try:
            check_adapter_id(name, base_name="")
        except LorapageError as exc:
            fail(prog, f"--lora-modules {item}: {exc.message}")
        modules[name] = path
    return modules


def adapter_roots(args: argparse.Namespace, modules: dict[str, str], prog: str = PROG) -> AdapterRoots:
    """``--adapter-root`` values (``DIR`` or ``TENANT=DIR``, each checked to exist), with the
    ``--lora-modules`` directories as the operator's own."""
    try:
        roots = AdapterRoots.parse(args.adapter_root, operator=modules.values())
    except ValueError as exc:
        fail(prog, str(exc))
    for root in roots.all_roots():
        if not root.is_dir():
            fail(prog, f"--adapter-root {root}: no such directory")
    return roots


def check_state_dir(state_dir: str | None) -> None:
    """End ``lorapage serve`` with one line when ``state_dir`` cannot hold its state: not a
    directory, or one it cannot write (permissions, a read-only file system)."""
    if state_dir is None:
        return
    try:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=state_dir):
            pass
    except OSError as exc:
        fail(PROG, f"--state-dir {state_dir}: cannot write there ({exc.strerror or exc}); give a writable directory")


def state_dir_problem(exc: BaseException) -> str:
    """What is wrong with the adapter registry in a state directory, and what to do, in one line."""
    text = " ".join(str(exc).split())
    if "not a database" in text or "malformed" in text:
        return (
            f"the adapter registry ({REGISTRY_FILE}) is corrupt ({text}); restore it from a backup, or move "
            "it away to start with an empty registry"
        )
    if "readonly" in text or "read-only" in text:
        return f"the adapter registry ({REGISTRY_FILE}) is read-only ({text}); make it writable"
    return f"the adapter registry ({REGISTRY_FILE}) cannot be used: {text}"


def check_root_tenants(roots: AdapterRoots, tenants: Iterable[str], prog: str = PROG) -> None:
    """End ``prog`` when a ``TENANT=DIR`` root names a tenant the tenants file does not have."""
    unknown = sorted(set(roots.tenants) - set(tenants))
    if unknown:
        fail(prog, f"--adapter-root names tenant(s) {', '.join(unknown)}, not in the tenants file")


def _tenants_file(path: str) -> Access:
    try:
        return Access.from_file(path)
    except (OSError, TenantsConfigError) as exc:
        fail(PROG, f"tenants file: {exc}")


def _demo_access(adapters: list[str]) -> Access:
    access, tenant_key, admin_key = Access.demo(adapters)
    print(f"lorapage: demo tenant key: {tenant_key}")
    print(f"lorapage: admin key:       {admin_key}")
    return access


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    modules = lora_modules(args)
    merge = merge_target(args, modules)
    check_prompts = merge_check_prompts(args) if merge is not None else []
    roots = adapter_roots(args, modules)
    keys = api_keys(args)
    window = slo_window(args)
    edge = edge_limits(args)
    config = engine_config(args)
    check_bases(args, merge)
    if merge is not None:  # the adapter is registered only to check the merge against: no envelope
        config = dataclasses.replace(config, shared_envelope="", shared_max_cost_pct=None)
    utilization = config.gpu_memory_utilization  # of the device, shared by every base's engine
    if (total := shared_device(args, config)) is not None:
        share = utilization_share(utilization, 1 + len(args.base), 0, 0, total)
        config = dataclasses.replace(config, gpu_memory_utilization=share)
    access_log = open_access_log(args)
    # The port first: a busy one ends the command before any key is printed or the model loads.
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        fail(PROG, f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    access = _tenants_file(args.tenants) if args.tenants else None
    if keys:
        access = Access(TenantsConfig.from_toml(api_key_tenants(keys), source="--api-key"))
        print(f"lorapage: single tenant {API_KEY_TENANT!r}: its API key (--api-key) opens every route")
    check_state_dir(config.state_dir)
    if access is not None:
        check_root_tenants(roots, access.tenants.tenants)
    try:
        engine = Engine(config, adapter_roots=roots)
    except StateDirError as exc:  # another server holds it
        fail(PROG, str(exc))
    except (sqlite3.Error, RegistrySchemaError) as exc:  # the registry file itself
        fail(PROG, f"--state-dir {config.state_dir}: {state_dir_problem(exc)}")
    except (OSError, ValueError) as exc:  # a model directory that is not one lorapage can serve
        fail(PROG, f"--model {config.model}: {exc}")
    try:
        for name, path in modules.items():
            engine.add_adapter(name, path)
    except LorapageError as exc:
        fail(PROG, f"adapter {name!r}: {exc.message}")
    bases = side_engines(args, config, roots, engine, utilization)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        if merge is not None:
            run_merge_check(runner, engine, merge, check_prompts, args.merge_check_tolerance)
            modules = {merge: ""}
        access = access or _demo_access(list(modules))  # new keys only for a server that is about to listen
        unusable = [m for m in modules if not any(access.may_use(t, m) for t in access.tenants.tenants)]
        if unusable:
            log.warning(
                "no tenant may use %s: access fails closed; name it in a tenant's `adapters`, or give a tenant "
                '`adapters = ["%s"]` to open every adapter without an owner',
                ", ".join(unusable),
                SHARED,
            )
        try:
            app = create_app(
                engine,
                access,
                max_body_bytes=args.max_body_bytes,
                shutdown_grace_s=args.shutdown_timeout,
                metrics_public=args.metrics_public,
                edge=edge,
                access_log=access_log,
                slo_window_s=window,
                bases=bases,
            )
        except ValueError as exc:  # a --base that cannot serve beside --model
            fail(PROG, f"--base: {exc}")
        if merge is None:
            print(f"lorapage: base model {engine.base_name!r}, adapters: {', '.join(modules) or 'none'}")
            for side in bases:
                print(f"lorapage: base model {side.base_name!r} beside it (sha256:{side.digest})")
        else:
            print(f"lorapage: dedicated deployment of adapter {merge!r}, merged into base model {engine.base_name!r}")

        def ready(port: int) -> None:
            print(f"lorapage: listening on http://{args.host}:{port}", flush=True)

        def reload() -> None:
            if args.tenants:
                reload_tenants(app, args.tenants)

        runner.run(serve_until_signal(app, app[ENGINES].engines, sock, ready, on_reload=reload))
    print("lorapage: stopped", flush=True)
    return 0


def check_bases(args: argparse.Namespace, merge: str | None) -> None:
    """``--base`` checked before any model loads: model directories, and not beside ``--merge``."""
    if args.base and merge is not None:
        fail(PROG, "--merge serves one adapter on one base: it does not take --base")
    for model in args.base:
        check_model_dir(model, flag="--base")


def shared_device(args: argparse.Namespace, config: EngineConfig) -> int | None:
    """The total bytes of the CUDA device the engines of ``--model`` and ``--base`` share when
    their pools are sized from ``--gpu-memory-utilization`` (None: one base, a CPU, or
    ``--num-pages`` sizing each pool)."""
    if not args.base or config.num_pages is not None:
        return None
    device = resolve_device(config.device)
    return torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None


def side_engines(
    args: argparse.Namespace, config: EngineConfig, roots: AdapterRoots, primary: Engine, utilization: float
) -> list[Engine]:
    """The engines of ``--base``'s bases, beside the primary's ``config`` (the command ends naming
    a directory that is no base, or a base that cannot serve beside the primary). On one CUDA
    device each engine's pool gets an equal share of ``utilization`` (:func:`utilization_share`)."""
    total = shared_device(args, config)
    bases, reserved, n = [], primary.step_reserve_bytes, 1 + len(args.base)
    for k, model in enumerate(args.base, start=1):
        side = side_config(config, model)
        if total is not None:
            side = dataclasses.replace(
                side, gpu_memory_utilization=utilization_share(utilization, n, k, reserved, total)
            )
        try:
            bases.append(Engine(side, adapter_roots=roots))
        except (OSError, ValueError) as exc:
            fail(PROG, f"--base {model}: {exc}")
        reserved += bases[-1].step_reserve_bytes
    return bases


def _loop_factory():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main())

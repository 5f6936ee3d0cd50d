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
import sqlite3
import sys
import tempfile
from pathlib import Path

import torch

from lorapage.adapters.names import check_adapter_id
from lorapage.adapters.state_lock import StateDirError
from lorapage.bases.serving import side_config, utilization_share
from lorapage.config import EngineConfig
from lorapage.engine import Engine
from lorapage.engine.devices import resolve_device
from lorapage.engine.flags import (
    adapter_roots,
    add_engine_arguments,
    add_state_arguments,
    check_model_dir,
    engine_config,
    lora_modules,
)
from lorapage.engine.merge_check import CHECK_PROMPTS, TOLERANCES, merge_and_check, read_check_prompts
from lorapage.errors import LorapageError
from lorapage.flags import fail, parser
from lorapage.fleet.promotion import PromotionRules, add_rule_arguments, rules_from
from lorapage.frontend.auth import Access
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
from lorapage.frontend.run import listen, serve_until_signal
from lorapage.heap import freeze_gc_heap
from lorapage.registry.store import REGISTRY_FILE, RegistrySchemaError
from lorapage.serve.app import create_app, reload_tenants
from lorapage.serve.dedicated import DEFAULT_WAIT_S, LocalDedicated
from lorapage.serve.engine_backend import ENGINES
from lorapage.sources import AdapterRoots
from lorapage.tenancy.tenants import SHARED, TenantsConfig, TenantsConfigError

log = logging.getLogger("lorapage.serve")
PROG = "lorapage serve"


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
    group.add_argument(
        "--auto-promote",
        action="store_true",
        help="the dedicated tier without an admin: an adapter outside the shared envelope registers (tier "
        "dedicated) and its first request starts its merged engine beside the shared one (merged, checked, then "
        "serving); its requests wait for it at most --dedicated-wait seconds, then get a 503 with Retry-After. "
        "An adapter whose own output tokens/s stay >= --promote-tokens-per-s for --promote-after seconds gets one "
        "too (the shared engine serves it meanwhile); either is demoted once its tokens/s stay < "
        "--demote-tokens-per-s for --demote-after seconds (default: off; POST /v1/adapters/{id}/promote starts "
        "one either way)",
    )
    group.add_argument(
        "--dedicated-wait",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="SECONDS",
        help="how long a request for an adapter whose merged engine is starting waits for it before a 503",
    )
    add_rule_arguments(group)  # --auto-promote's hot-enough rules, as `lorapage fleet`'s


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


def promotion_rules(args: argparse.Namespace, prog: str = PROG) -> PromotionRules:
    """``--auto-promote``'s hot-enough rules from the flags; a bad value ends the command naming it."""
    try:
        return rules_from(args)
    except ValueError as exc:
        fail(prog, f"--auto-promote / --promote-* / --demote-*: {exc}")


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
    modules = lora_modules(args, PROG)
    merge = merge_target(args, modules)
    if not 0 < args.dedicated_wait < float("inf"):
        fail(PROG, f"--dedicated-wait must be a number of seconds > 0; got {args.dedicated_wait}")
    rules = promotion_rules(args)
    check_prompts = merge_check_prompts(args) if merge is not None else []
    roots = adapter_roots(args, modules, PROG)
    keys = api_keys(args, PROG)
    window = slo_window(args, PROG)
    edge = edge_limits(args, PROG)
    config = engine_config(args, PROG)
    check_bases(args, merge)
    if merge is not None:  # the adapter is registered only to check the merge against: no envelope
        config = dataclasses.replace(config, shared_envelope="", shared_max_cost_pct=None)
    utilization = config.gpu_memory_utilization  # of the device, shared by every base's engine
    if (total := shared_device(args, config)) is not None:
        share = utilization_share(utilization, 1 + len(args.base), 0, 0, total)
        config = dataclasses.replace(config, gpu_memory_utilization=share)
    access_log = open_access_log(args, PROG)
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
        check_root_tenants(roots, access.tenants.tenants, PROG)
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
                dedicated=LocalDedicated(engine, auto=args.auto_promote, wait_s=args.dedicated_wait, rules=rules),
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
            freeze_gc_heap()  # what startup built stays out of the oldest generation's collections (heap.py)
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
        check_model_dir(model, PROG, flag="--base")


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

"""The HTTP front end's flags, shared by ``lorapage serve`` and ``lorapage fleet`` (whose ingress
serves the same front end): listening, tenants and keys, body and connection bounds, the request
log and the SLO window, each checked so a bad value ends the command naming it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

from lorapage.flags import fail
from lorapage.frontend.access_log import AccessLog
from lorapage.frontend.app import DEFAULT_MAX_BODY_BYTES
from lorapage.frontend.edge import EdgeLimits
from lorapage.sources import AdapterRoots
from lorapage.tenancy.slo import DEFAULT_WINDOW_S
from lorapage.tenancy.tenants import SHARED, hash_key

API_KEY_ENV = "LORAPAGE_API_KEY"  # vLLM reads VLLM_API_KEY


API_KEY_TENANT = "default"  # the one tenant of --api-key


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


def edge_limits(args: argparse.Namespace, prog: str) -> EdgeLimits:
    """``--header-timeout`` and ``--max-connections-per-ip``, checked."""
    if not args.header_timeout > 0 or args.max_connections_per_ip < 0:
        fail(prog, "--header-timeout must be > 0 seconds and --max-connections-per-ip >= 0 (0: no cap)")
    return EdgeLimits(args.header_timeout, args.max_connections_per_ip)


def api_keys(args: argparse.Namespace, prog: str) -> list[str]:
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


def slo_window(args: argparse.Namespace, prog: str) -> float:
    """``--slo-window``, checked (the command ends naming it when it is not a number of seconds > 0)."""
    if not 0 < args.slo_window < float("inf"):
        fail(prog, f"--slo-window must be a number of seconds > 0, got {args.slo_window}")
    return float(args.slo_window)


def open_access_log(args: argparse.Namespace, prog: str) -> AccessLog | None:
    """``--access-log`` opened (None without it); the command ends naming it when it cannot be."""
    try:
        return AccessLog(args.access_log) if args.access_log else None
    except OSError as exc:
        fail(prog, f"--access-log {args.access_log}: {exc.strerror or exc}")


def check_root_tenants(roots: AdapterRoots, tenants: Iterable[str], prog: str) -> None:
    """End ``prog`` when a ``TENANT=DIR`` root names a tenant the tenants file does not have."""
    unknown = sorted(set(roots.tenants) - set(tenants))
    if unknown:
        fail(prog, f"--adapter-root names tenant(s) {', '.join(unknown)}, not in the tenants file")

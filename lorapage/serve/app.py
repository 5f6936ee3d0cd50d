"""``lorapage serve``'s app: the one front end (:func:`lorapage.frontend.app.build_app`) over the
engines in this process (:class:`~lorapage.serve.engine_backend.EngineBackend`), with the admin,
audit and base-migration routes over the primary engine's registry, and the tenants file's reload
on SIGHUP."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from lorapage.frontend.access_log import AccessLog
from lorapage.frontend.admin import add_admin_routes
from lorapage.frontend.admin_ops import Admin
from lorapage.frontend.app import BACKGROUND, DEFAULT_MAX_BODY_BYTES, STATE, ServerState, build_app
from lorapage.frontend.audit_route import add_audit_routes
from lorapage.frontend.auth import Access
from lorapage.frontend.bases_route import add_base_routes
from lorapage.frontend.edge import EdgeLimits
from lorapage.frontend.push_route import PUSH_MAX_BODY_BYTES, add_push_routes
from lorapage.serve.dedicated import LocalDedicated
from lorapage.serve.engine_backend import ENGINES, EngineBackend
from lorapage.serve.local_admin import LocalDeployment
from lorapage.serve.upgrades import LocalUpgrades
from lorapage.tenancy.slo import DEFAULT_WINDOW_S
from lorapage.tenancy.tenants import TenantsConfig, TenantsConfigError

if TYPE_CHECKING:
    from lorapage.engine import Engine

log = logging.getLogger("lorapage.server")  # the name operators filter on since round 1


def reload_tenants(app: web.Application, path: str) -> None:
    """Apply an edited tenants file (``lorapage serve``'s SIGHUP): new keys, adapter lists and
    quotas; a bad file is logged and the old one kept. Buckets keep their level and running
    requests their reservations. Audited in the registry, off the loop."""
    state = app[STATE]
    try:
        config = TenantsConfig.load(path)
    except (OSError, TenantsConfigError) as exc:
        log.error("tenants file not reloaded, keeping the old one: %s", exc)
        _audit_later(app, "tenants_reload", outcome=f"refused: the file did not load ({type(exc).__name__})")
        return
    state.set_tenants(config)
    log.info("tenants file reloaded: %d tenants", len(config.tenants))
    _audit_later(app, "tenants_reload", after={"tenants": sorted(config.tenants)})


def _audit_later(app: web.Application, action: str, *, after: dict | None = None, outcome: str = "ok") -> None:
    """Audit an action taken on a signal (``sighup``), committed off the loop; a failure to
    write it is logged, never raised into the signal handler."""
    engine = app[ENGINES].engine

    async def record() -> None:
        try:
            await engine.admin.catalog.record(action, None, actor="sighup", after=after, outcome=outcome)
        except Exception:
            log.exception("the audit row of %s was not written", action)

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # called with no loop running (a script): the write needs the engine's loop
        log.warning("%s not audited: no event loop is running", action)
        return
    task = loop.create_task(record())
    background = app[BACKGROUND]
    background.add(task)  # held until done: the loop keeps only weak references
    task.add_done_callback(background.discard)


def create_app(
    engine: Engine,
    access: Access,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_grace_s: float = 10.0,
    metrics_public: bool = False,
    edge: EdgeLimits | None = None,
    access_log: AccessLog | None = None,
    slo_window_s: float = DEFAULT_WINDOW_S,
    bases: Sequence[Engine] = (),
    max_push_bytes: int = PUSH_MAX_BODY_BYTES,
    dedicated: LocalDedicated | None = None,
) -> web.Application:
    """``lorapage serve``'s app: the front end over ``engine`` (the caller owns it) and, with
    ``bases``, the engines of other bases served beside it (the primary's registry is the
    server's; each request runs on its adapter version's base: :mod:`lorapage.serve.engines`),
    with the admin, base-migration and audit routes over the primary's registry, and pushes of
    versions from memory to the primary (bodies of at most ``max_push_bytes``). Admin
    registration reads adapter directories only under the engine's ``adapter_roots`` (an engine
    built to read any directory lets HTTP registration read none). ``dedicated``: the merged
    engines of promoted adapters (:mod:`lorapage.serve.dedicated`; default: promoted by the admin
    routes only). The other keyword arguments are :func:`build_app`'s.
    """
    local = EngineBackend(engine, bases, dedicated)
    # Owners registered over the admin API survive restarts in the engine's registry.
    for adapter_id, owner in engine.admin.catalog.owners().items():
        access.set_owner(adapter_id, owner)

    def serve_routes(app: web.Application) -> None:
        app[ENGINES] = local
        state: ServerState[EngineBackend] = app[STATE]
        deployment = LocalDeployment(local, state)
        routes = add_admin_routes(app, Admin(engine.admin.catalog, deployment))
        deployment.add_routes(app, routes)  # promote, demote: the fleet's routes
        add_audit_routes(app)
        add_base_routes(app, LocalUpgrades(local.engines))
        add_push_routes(app, engine.admin.push, max_push_bytes)

    return build_app(
        local,
        access,
        serve_routes,
        max_body_bytes=max_body_bytes,
        shutdown_grace_s=shutdown_grace_s,
        metrics_public=metrics_public,
        edge=edge,
        access_log=access_log,
        slo_window_s=slo_window_s,
    )

"""The fleet's ingress: ``lorapage serve``'s HTTP front end as a Ray Serve deployment.

The ingress does not go through Ray Serve's HTTP proxy (the fleet starts Serve with it disabled):
its one replica runs the aiohttp application of :mod:`lorapage.frontend.app` itself, on the fleet's
``host:port``, in the replica's event loop. So the routes, the checks and their order, the error
JSON, ``/health`` (503 while shutting down), SSE, metrics, SLOs and the request log are
``lorapage serve``'s own; only where a request goes differs: :class:`~lorapage.fleet.backend.FleetBackend`
(deployment handles to the engine replicas, routed by adapter affinity). The admin routes are the
same routes as ``lorapage serve``'s over the fleet's operations (:mod:`lorapage.fleet.admin`: the
fleet's registry, its replicas), plus promote and demote; so are the base-upgrade routes
(validate, migrate: :mod:`lorapage.fleet.upgrades`), toward a base the fleet runs (``--base``).

Quotas are fleet-wide because this deployment runs exactly one replica and holds every tenant's
token buckets (a restart of it refills them, as a restart of ``lorapage serve`` does). It holds
the fleet's adapter registry too (:mod:`lorapage.fleet.registry`) and resolves every request to
one version ``id@N`` before it sends it; replicas mirror the registry through their heartbeats
(:meth:`FleetIngress.sync`), whose stats and series ``/metrics`` and ``/internal/state``
re-export. ``--lora-modules`` are registered in the registry (checked on a replica) before the
ingress listens (:meth:`FleetIngress.register_modules`), so a bad one fails the deployment, saying why.

An edited tenants file reaches the ingress as :meth:`FleetIngress.reload_tenants` (``lorapage
fleet`` calls it on SIGHUP). With a state directory the accepted text is kept there, so an
ingress that Ray restarts keeps the reloaded keys rather than the file the fleet started with.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from lorapage.adapters.state_lock import StateDirLock
from lorapage.fleet.admin import FleetDeployment
from lorapage.fleet.auto_promote import AutoPromoter
from lorapage.fleet.backend import FleetBackend
from lorapage.fleet.bases import FleetBases
from lorapage.fleet.config import FleetConfig
from lorapage.fleet.dedicated import DedicatedDeployments
from lorapage.fleet.messages import EngineProfile, Heartbeat, SyncReply, answered
from lorapage.fleet.prewarm import PREWARMS
from lorapage.fleet.registry import FleetRegistry
from lorapage.fleet.telemetry import ReplicaReports
from lorapage.fleet.traffic import fleet_tiers, tiers_for
from lorapage.fleet.upgrades import FleetUpgrades
from lorapage.frontend.access_log import AccessLog
from lorapage.frontend.admin import add_admin_routes
from lorapage.frontend.admin_ops import Admin
from lorapage.frontend.app import STATE, ServerState, build_app
from lorapage.frontend.audit_route import add_audit_routes
from lorapage.frontend.auth import Access
from lorapage.frontend.bases_route import add_base_routes
from lorapage.frontend.run import start
from lorapage.registry.store import REGISTRY_FILE, Registry
from lorapage.tenancy.tenants import TenantsConfig, TenantsConfigError

log = logging.getLogger("lorapage.fleet")

TENANTS_FILE = "fleet-tenants.json"  # the last tenants text a reload accepted, and the start file it replaced


class FleetIngress:
    """The front end in front of the engine replicas, serving HTTP on ``config.host:config.port``."""

    app: web.Application  # lorapage.frontend.app's, over a FleetBackend
    runner: web.AppRunner | None  # serving it (None: not listening)
    port: int

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self, engines: Any, config: FleetConfig, bases: Sequence[Any] = ()
    ) -> None:
        """Ask the engines what they run (waiting for a replica of each base), build the front end,
        listen; the deployment counts as running once this returns, so it answers at once."""
        profile: EngineProfile = await engines.profile.remote()  # they all run one config
        fleet_bases = FleetBases([engines, *bases])  # one deployment per base (--base), the primary's first
        await fleet_bases.served()
        self.setup(engines, config, fleet_bases, profile)
        await self.register_modules()
        self.runner, self.port = await start(self.app, (config.host, config.port))

    def setup(self, engines: Any, config: FleetConfig, bases: FleetBases, profile: EngineProfile) -> None:
        """Everything but the engines' answers and the listener: the registry, tenants, the
        dedicated deployments and the aiohttp application (:attr:`app`) over a :class:`FleetBackend`."""
        self.engines = engines  # a DeploymentHandle to the EngineReplica deployment
        self.config = config
        self.profile = profile
        self.runner = None
        self.access = Access(TenantsConfig.from_toml(self._tenants_text()))
        # One writer per state dir: a second fleet (or server) on it fails to deploy, saying why.
        self._state_lock = StateDirLock(Path(config.state_dir)) if config.state_dir is not None else None
        state = Path(config.state_dir) / REGISTRY_FILE if config.state_dir is not None else ":memory:"
        self.registry = FleetRegistry(Registry(state), base_digest=profile.base_digest)
        for adapter_id in self.registry.index.ids():  # owners registered over the admin API, restored
            if (owner := self.registry.index.owner(adapter_id)) is not None:
                self.access.set_owner(adapter_id, owner)
        self.reports = ReplicaReports(config.sync_period_s, time.monotonic)
        # The fleet's one traffic record: the replicas' counts summed in the registry, tiers judged here.
        self.tiers, self.traffic = fleet_tiers(config.engine, self.registry.registry, time.time)
        # Promoted adapters' merged deployments (Serve applications of their own), and --auto-promote.
        self.dedicated = DedicatedDeployments(config, self.registry, self._profile)
        self.auto = AutoPromoter(self.dedicated, config.dedicated.interval_s) if config.dedicated.auto else None
        self.backend = FleetBackend(config, bases, profile, self.registry, self.reports, self.dedicated, self.auto)
        self.app = build_app(
            self.backend,
            self.access,
            self._add_routes,
            max_body_bytes=config.max_body_bytes,
            metrics_public=config.metrics_public,
            edge=config.edge,
            # An access log the ingress cannot open fails its deployment, saying why (the CLI checks it first).
            access_log=AccessLog(config.access_log) if config.access_log else None,
            slo_window_s=config.slo_window_s,
        )
        self.state: ServerState[FleetBackend] = self.app[STATE]

    async def _profile(self) -> EngineProfile:
        return self.profile

    def _add_routes(self, app: web.Application) -> None:
        """``lorapage serve``'s admin, audit and base-upgrade routes over the fleet's registry and
        replicas, and the fleet's own (promote, demote)."""
        state = app[STATE]
        deployment = FleetDeployment(
            access=self.access,
            registry=self.registry,
            engines=self.engines,
            reports=self.reports,
            profile=self.profile,
            in_flight=state.in_flight,
            draining=state.draining,
            adapter_roots=self.config.roots(),
            sync_period_s=self.config.sync_period_s,
            dedicated=self.dedicated,
            tiers=self.tiers,
        )
        routes = add_admin_routes(app, Admin(self.registry, deployment))
        add_audit_routes(app)
        models = [self.config.engine.model, *self.config.bases]
        upgrades = FleetUpgrades(
            self.backend.bases, self.registry, self.profile.base_digest, models, self.registry.write
        )
        add_base_routes(app, upgrades)
        deployment.add_routes(app, routes)

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown of the replica: stop taking requests (``/health`` 503),
        let running ones finish within the grace period, close the listener."""
        runner = getattr(self, "runner", None)  # None: the constructor failed before it listened
        if runner is not None:
            await runner.cleanup()
        tiers = getattr(self, "tiers", None)
        if tiers is not None:
            await tiers.stop()  # the counts reported since the last write

    # -- Ray-side calls (the CLI, the replicas) ---------------------------------------------------

    async def register_modules(self) -> None:
        """Register ``--lora-modules`` in the fleet's registry, each checked on a replica: same
        content is the same version, new content a new one, as ``lorapage serve`` does at each start."""
        for name, path in self.config.lora_modules:
            handle = self.engines.options(multiplexed_model_id=name)
            prepared = answered(await handle.prepare_adapter.remote(path, None, None))
            await self.registry.write(functools.partial(self.registry.add, name, None, prepared, activate=True))

    def ready(self) -> list[str]:
        """The registered adapter ids (the deployment runs once :meth:`register_modules` has)."""
        return self.registry.index.ids()

    async def sync(self, beat: Heartbeat) -> SyncReply:
        """A replica's heartbeat: recorded (its traffic counts added to the fleet's), and answered
        with what it must mirror and the tiers it must carry out."""
        self.reports.record(beat)
        self.traffic.restore_traffic(beat.traffic)
        self.tiers.start()  # judged every tier_interval_s on this loop (once started, a no-op)
        self.dedicated.ensure_adopted()  # a restarted ingress takes over the merged deployments running
        if self.auto is not None:  # heartbeats never stop: the rules are judged with traffic or without
            self.auto.ensure_running()
        reply = self.registry.changes_since(beat.epoch, beat.generation, self.access.tenants.weights())
        tiers = tiers_for(self.tiers, beat.tiers_judged, reply.full)
        return dataclasses.replace(
            reply, prewarms=PREWARMS.take(beat.replica_id), tiers=tiers, tiers_judged=self.tiers.judged
        )

    def reload_tenants(self, text: str) -> str:
        """Apply an edited tenants file: keys, adapter lists, quotas (buckets keep their level)
        and VTC shares (at the replicas' next heartbeat); a bad file changes nothing. Returns
        what happened, for the caller's log."""
        try:
            config = TenantsConfig.from_toml(text, source="the reloaded tenants file")
        except TenantsConfigError as exc:
            self._audit_reload(outcome=f"refused: the file did not load ({type(exc).__name__})")
            return f"tenants file not reloaded, keeping the old one: {exc}"
        self.state.set_tenants(config)
        if self.config.state_dir is not None:
            record = {"origin": _sha256(self.config.tenants_toml), "text": text}
            target = Path(self.config.state_dir) / TENANTS_FILE
            target.parent.mkdir(parents=True, exist_ok=True)
            temp = target.with_suffix(".tmp")
            temp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(temp, target)
        self._audit_reload(after={"tenants": sorted(config.tenants)})
        return f"tenants file reloaded: {len(config.tenants)} tenants"

    def _audit_reload(self, *, after: dict | None = None, outcome: str = "ok") -> None:
        """Audit a reload as ``lorapage serve`` audits its SIGHUP (the fleet's CLI calls
        :meth:`reload_tenants` on one); a failure to write the row is logged, not raised."""
        try:
            self.registry.note("tenants_reload", None, actor="sighup", after=after, outcome=outcome)
        except Exception:
            log.exception("the audit row of a tenants reload was not written")

    def _tenants_text(self) -> str:
        """The tenants text a reload accepted for this fleet's start file, else the start file."""
        if self.config.state_dir is not None:
            try:
                record = json.loads((Path(self.config.state_dir) / TENANTS_FILE).read_text(encoding="utf-8"))
                if record.get("origin") == _sha256(self.config.tenants_toml):
                    return str(record["text"])
            except (OSError, ValueError):
                pass
        return self.config.tenants_toml


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()

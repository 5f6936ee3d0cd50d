"""The fleet's admin: ``lorapage serve``'s admin routes (:mod:`lorapage.frontend.admin`,
:mod:`lorapage.frontend.audit_route`) over the fleet's registry and its replicas, and the fleet's own
routes (promote, demote).

The fleet's :class:`~lorapage.frontend.admin_ops.Admin` is the one ``lorapage serve`` runs, over the
fleet's registry (its :class:`~lorapage.frontend.admin_ops.VersionStore`) and a
:class:`FleetDeployment` (the replicas: fan-out, promotion and demotion). The ingress
holds the fleet's registry (:mod:`lorapage.fleet.registry`) and answers from it; what needs an
engine goes to one replica through the adapter-affinity router, so it lands on the adapter's
owner: a registration is fetched and checked there (then committed here, answered 201, and
servable on every replica at once, since a replica that meets a version it lacks syncs first), a
pre-warm loads it there. What every replica must do follows the registry through the replicas'
heartbeats (within ``sync_period_s``): a pin holds the version resident on **every** replica
(bounded on each by ``--max-pinned-fraction``; the pin is checked and loaded on the owner before
it is answered), an unload drops it from every pool, a delete drops it everywhere once its
requests end. The ingress sees every request, so its own counts decide a delete's drain, exactly
as on one server. Promotion and demotion start and remove an adapter's dedicated merged
deployment (:mod:`lorapage.fleet.dedicated`); an adapter outside the shared envelope registers
(tier ``dedicated``) and is served once promoted. A fleet samples no check prompts from traffic
(``sample`` true is refused).

Every change is audited in the registry as the admin key's id (``actor``:
:meth:`~lorapage.frontend.auth.Access.admin_actor`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from lorapage.adapters.cache import AdapterInfo
from lorapage.adapters.names import parse_name
from lorapage.adapters.tiers import Tier
from lorapage.engine.tiering import TierKeeper
from lorapage.errors import ConflictError
from lorapage.fleet.dedicated import DedicatedDeployments
from lorapage.fleet.messages import EngineProfile, answered
from lorapage.fleet.registry import FleetRegistry
from lorapage.fleet.telemetry import ReplicaReports
from lorapage.frontend.admin import AdminRoutes, cost_fields, known_id, wait_until
from lorapage.frontend.auth import Access
from lorapage.frontend.registration import Registration
from lorapage.frontend.responses import TRAFFIC_HOURS, AdapterOut, AdapterVersionOut, TrafficOut
from lorapage.registry.drift_state import CheckPrompts
from lorapage.registry.prepare import PreparedVersion
from lorapage.sources import AdapterRoots

T = TypeVar("T")
_TIER_ORDER = ("gpu", "ram")  # the best tier of any replica is the adapter's tier


class FleetAdapterOut(AdapterOut):
    """An adapter as the fleet's admin routes describe it: also where it is on each replica."""

    replicas: dict[str, str] = msgspec.field(default_factory=dict)  # replica id -> gpu | ram


class FleetDeployment:
    """The fleet's :class:`~lorapage.frontend.admin_ops.Deployment`: the replicas, reached through
    the ingress's handle (passed in: this module does not import the ingress)."""

    def __init__(
        self,
        *,
        access: Access,
        registry: FleetRegistry,
        engines: Any,  # the DeploymentHandle to the engine replicas
        reports: ReplicaReports,
        profile: EngineProfile,
        in_flight: Counter[str | None],
        draining: set[str],
        adapter_roots: AdapterRoots,
        sync_period_s: float,
        dedicated: DedicatedDeployments,
        tiers: TierKeeper,
    ) -> None:
        """``tiers``: the fleet's traffic record and tiers (:mod:`lorapage.fleet.traffic`)."""
        self.access, self.registry, self.engines, self.reports = access, registry, engines, reports
        self.dedicated, self.tiers = dedicated, tiers
        self.profile, self.in_flight, self.draining = profile, in_flight, draining
        self.base_name = profile.base_name
        self.roots, self.sync_period_s = adapter_roots, sync_period_s
        self.samples_traffic = False  # the ingress keeps no sample of any adapter's traffic

    def _on_owner(self, name: str) -> Any:
        """The replica handle routed like a request for ``name``'s adapter (to its owner)."""
        return self.engines.options(multiplexed_model_id=parse_name(name)[0])

    # -- describing -------------------------------------------------------------------------------

    def listed(self) -> list[str]:
        base = self.profile.base_digest
        rows = [row for i in self.registry.index.ids() if (row := self.registry.index.row(i)) is not None]
        return [r.key for r in rows if r.base_digest == base]

    async def describe(self, names: Sequence[str]) -> list[AdapterOut]:
        keys = [self.registry.resolve_version(name) for name in names]
        infos = await self.engines.describe.remote(keys) if keys else []
        return [self._out(k, answered(info)) for k, info in zip(keys, infos, strict=True)]

    def _out(self, key: str, info: AdapterInfo) -> FleetAdapterOut:
        adapter_id, version = parse_name(key)
        row = self.registry.index.row(key)
        assert row is not None and version is not None, key
        replicas = self.reports.tiers(key)
        tier = next((t for t in _TIER_ORDER if t in replicas.values()), "disk")
        promotion = self.dedicated.promotions.get(adapter_id)
        return FleetAdapterOut(
            id=adapter_id,
            owner=self.registry.index.owner(adapter_id),
            parent=self.profile.base_name,
            path=info.path,
            rank=info.rank,
            target_modules=list(info.target_modules),
            size_bytes=info.size_bytes,
            num_params=info.num_params,
            tier=tier,
            in_flight=self.in_flight.get(key, 0),
            pinned=row.pinned,
            version=version,
            current=self.registry.index.current(adapter_id),
            digest=row.digest,
            source=row.source,
            base_digest=self.profile.base_digest,
            versions=[r.version for r in self.registry.index.versions(adapter_id)],
            replicas=replicas,
            dedicated=promotion.out() if promotion is not None else None,
            # merged: served by its dedicated deployment; else judged from every replica's traffic
            traffic_tier=Tier.MERGED.value if self.dedicated.route(key) is not None else self.tiers.tier(key).value,
            kept_hot=info.kept_hot,  # on the replica that described it (each carries the fleet's tiers out)
            **cost_fields(info),
        )

    async def traffic(self, out: AdapterOut) -> TrafficOut | None:
        """From the fleet's traffic table: every replica's counts, summed (the last few seconds'
        reach it with the replicas' next heartbeats)."""
        rows = await self.tiers.recent(out.id, TRAFFIC_HOURS)
        first_hour = int(self.tiers.wall_clock() // 3600) - TRAFFIC_HOURS + 1
        return TrafficOut.of([r for r in rows if r.version == out.version], first_hour)

    def versions(self, adapter_id: str) -> list[AdapterVersionOut]:
        base, current = self.profile.base_digest, self.registry.index.current(adapter_id)
        return [
            AdapterVersionOut(
                id=row.key,
                adapter_id=row.adapter_id,
                version=row.version,
                digest=row.digest,
                source=row.source,
                base_digest=row.base_digest,
                created=row.created,
                current=row.version == current,
                servable=row.base_digest == base,
                in_flight=self.in_flight.get(row.key, 0),
                projected_cost_pct=row.projected_cost_pct,
            )
            for row in self.registry.index.versions(adapter_id)
        ]

    # -- what a change does on the replicas ------------------------------------------------------

    async def add_version(self, reg: Registration, source: str, actor: str) -> tuple[str, bool]:
        """Fetched and checked on the id's owner replica, then committed here."""
        self.registry.index.check_owner(reg.id, reg.owner)
        # envelope off: an adapter outside it registers with tier dedicated, its requests refused
        # (the envelope's 400) until it is promoted to a dedicated deployment of its own.
        got = self._on_owner(reg.id).prepare_adapter.remote(
            source, reg.sha256, reg.expected_base_digest, reg.owner, False
        )
        prepared: PreparedVersion = answered(await got)
        row, created = await self.registry.write(
            lambda: self.registry.add(reg.id, reg.owner, prepared, activate=reg.activate, actor=actor)
        )
        return row.key, created

    def key_for(self, name: str, action: str) -> str:
        return self.registry.resolve_version(name)

    def check_removable(self, name: str, keys: list[str]) -> None:
        """409 while the id has a dedicated deployment (demote it first)."""
        promotion = self.dedicated.promotions.get(parse_name(name)[0])
        if promotion is not None and promotion.state != "failed" and promotion.key in keys:
            raise ConflictError(
                f"adapter {promotion.key!r} has a dedicated deployment ({promotion.state}); demote it first "
                f"(POST /v1/adapters/{promotion.adapter_id}/demote)",
                param="id",
            )

    async def check_pin(self, key: str) -> None:
        """A pin holds the version resident on every replica (each bounded by
        ``--max-pinned-fraction``: they hold the same pins): checked on its owner."""
        answered(await self._on_owner(key).check_pin.remote(key))

    async def make_resident(self, key: str) -> None:
        """Loaded on the replica the router sends its requests to (an owner); the others follow a
        pin within a heartbeat."""
        answered(await self._on_owner(key).load_adapter.remote(key))

    async def drop(self, key: str, actor: str) -> None:
        """From every replica's pool (not while it runs there, nor if pinned); done once no
        replica reports it in its pool, or after a few heartbeats."""
        await self.registry.write(lambda: self.registry.drop(key, actor=actor))
        await wait_until(lambda: "gpu" not in self.reports.tiers(key).values(), 3 * self.sync_period_s)

    def check_prompts_stored(self, stored: CheckPrompts) -> None:
        return None  # the ingress samples no traffic (the routes refuse ``sample``)

    def internal_state(self) -> dict[str, Any]:
        ingress = {
            "requests_in_flight": sum(self.in_flight.values()),
            "in_flight_by_adapter": {k or "none": v for k, v in self.in_flight.items() if v},
            "draining_adapters": sorted(self.draining),
            "registry_generation": self.registry.generation,
            "dedicated": {i: p.out() for i, p in sorted(self.dedicated.promotions.items())},
        }
        replicas = {rid: beat.stats for rid, beat in self.reports.live().items()}
        return {"ingress": ingress, "replicas": replicas}

    # -- the fleet's own routes -------------------------------------------------------------------

    def add_routes(self, app: web.Application, routes: AdminRoutes) -> None:
        """Promote and demote (the admin key only), answered as the shared admin routes answer."""

        async def promote(request: web.Request) -> web.Response:
            """Start a dedicated deployment of ``id``'s version (``id``: its current one), merged
            into the base and checked before it takes traffic: 202 with the adapter
            (``dedicated.state`` ``starting``; ``GET`` shows ``merged`` once it serves, or ``failed``
            and why). 409 when the id has one already."""
            actor = self.access.admin_actor(request)
            key = self.registry.resolve_version(request.match_info["id"])
            if key in self.draining:  # a DELETE ?drain=true waits on it: a deployment would outlive the version
                raise ConflictError(f"adapter {key!r} is being deleted; it is not promoted", param="id")
            self.dedicated.promote(key, actor)
            return await routes.describe(request, key, status=202)

        async def demote(request: web.Request) -> web.Response:
            """Route the id back to the shared pool and delete its dedicated deployment; 409
            unless it has one serving."""
            actor = self.access.admin_actor(request)
            adapter_id = request.match_info["id"]
            promoted = {adapter_id} if adapter_id in self.dedicated.promotions else set()  # deleted since: demoted
            known_id(adapter_id, set(self.registry.index.ids()) | promoted)
            promotion = await self.dedicated.demote(adapter_id, actor)
            if self.registry.index.row(promotion.key) is None:  # the version was deleted while it was promoted
                return web.json_response({"id": promotion.key, "object": "adapter", "dedicated": None})
            return await routes.describe(request, promotion.key)

        app.router.add_post("/v1/adapters/{id}/promote", promote)
        app.router.add_post("/v1/adapters/{id}/demote", demote)

"""``lorapage serve``'s :class:`~lorapage.frontend.admin_ops.Deployment`: the engines in this process.

The store is the primary engine's catalog (its registry is the server's; the other bases' engines
mirror it after each request, :meth:`~lorapage.serve.engines.Engines.sync`); a registration goes
to the engine of the base the version is bound to (:meth:`LocalDeployment.add_version`);
pins, loads and unloads act on the primary's pool (:meth:`~lorapage.serve.engines.Engines.on_primary`).
A version is described from the engine of the base it runs on, with its last 24 hours of traffic.
Promote and demote (the fleet's routes) start and close an adapter's merged engine beside the
shared one (:mod:`lorapage.serve.dedicated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from lorapage.adapters.digest import digest_param
from lorapage.adapters.names import parse_name
from lorapage.adapters.tiers import Tier
from lorapage.errors import AdapterBaseMismatchError, AdapterBaseUnknownError, AdapterEnvelopeError, ConflictError
from lorapage.frontend.admin import AdminRoutes, cost_fields, known_id
from lorapage.frontend.registration import Registration
from lorapage.frontend.responses import TRAFFIC_HOURS, AdapterOut, AdapterVersionOut, TrafficOut
from lorapage.frontend.state import ServerState
from lorapage.registry.drift_state import CheckPrompts
from lorapage.serve.dedicated import check_promotable
from lorapage.serve.engine_backend import EngineBackend

if TYPE_CHECKING:
    from lorapage.engine import Engine


class LocalDeployment:
    """Versions as ``local``'s engines run them; ``state``: the front end's (requests in flight)."""

    def __init__(self, local: EngineBackend, state: ServerState[Any]) -> None:
        self.local, self.state = local, state
        self.engines, self.admin, self.dedicated = local.engines, local.engine.admin, local.dedicated
        self.catalog = self.admin.catalog
        self.base_name = local.engine.base_name
        self.roots = self.catalog.roots
        self.samples_traffic = True  # opted-in adapters' prompts are sampled (server/prompt_sampler.py)

    def listed(self) -> list[str]:
        return [info.name for info in self.admin.served()]

    async def describe(self, names: Sequence[str]) -> list[AdapterOut]:
        return [self._describe(name) for name in names]

    def _describe(self, name: str) -> AdapterOut:
        """``name`` (``id``: its current version, or ``id@N``) as the admin routes show it."""
        try:
            engine, name = self.engines.serving(name)  # the engine of the base it runs on
            info = engine.admin.info(name)
        except AdapterEnvelopeError:  # tier dedicated: registered for a merged engine (--auto-promote)
            engine, info = self.local.engine, self.admin.dedicated_info(name)
        versions = self.catalog.versions(info.adapter_id)
        promotion = self.dedicated.promotions.get(info.adapter_id)
        merged = self.dedicated.route(info.name) is not None
        current = next((v.version for v in versions if v.current), None)
        state = self.state
        return AdapterOut(
            id=info.adapter_id,
            owner=state.access.owners.get(info.adapter_id),
            parent=engine.base_name,
            path=info.path,
            rank=info.rank,
            target_modules=list(info.target_modules),
            size_bytes=info.size_bytes,
            num_params=info.num_params,
            tier=info.tier,
            in_flight=state.in_flight.get(info.name, 0),
            pinned=info.pinned,
            version=info.version,
            current=current,
            digest=info.digest,
            source=info.source,
            base_digest=engine.digest,
            versions=[v.version for v in versions],
            traffic_tier=Tier.MERGED.value if merged else info.traffic_tier,
            kept_hot=info.kept_hot,
            status="draining" if info.name in state.draining else info.status,
            dedicated=promotion.out() if promotion is not None else None,
            **cost_fields(info),
        )

    async def traffic(self, out: AdapterOut) -> TrafficOut | None:
        rows = await self.admin.traffic(out.id, TRAFFIC_HOURS)
        first_hour = int(self.admin.wall_clock() // 3600) - TRAFFIC_HOURS + 1
        return TrafficOut.of([r for r in rows if r.version == out.version], first_hour)

    def versions(self, adapter_id: str) -> list[AdapterVersionOut]:
        return [
            AdapterVersionOut(
                id=v.key,
                adapter_id=v.adapter_id,
                version=v.version,
                digest=v.digest,
                source=v.source,
                base_digest=v.base_digest,
                created=v.created,
                current=v.current,
                servable=v.servable,
                in_flight=self.state.in_flight.get(v.key, 0),
                projected_cost_pct=v.projected_cost_pct,
            )
            for v in sorted(self.catalog.versions(adapter_id), key=lambda v: v.version)
        ]

    async def add_version(self, reg: Registration, source: str, actor: str) -> tuple[str, bool]:
        """On the primary, unless it was trained on another base served here: its
        ``expected_base_digest`` names that base, or (none given) the primary cannot bind it
        (another base, or a name it does not know) and that base's engine binds it by its metadata
        (``base_model_name_or_path``: that base's own names, or ``--base-names``). Then that engine
        fetches and checks it, the primary's registry stores it, and that engine serves it.
        Otherwise the primary's refusal stands."""
        engines, expected = self.engines, reg.expected_base_digest
        side = None  # the engine of another base served here that ``expected`` names
        if engines.several and expected is not None:
            side = engines.side_engine(digest_param(expected, "expected_base_digest"))
        if side is not None:
            return await self._add_on(side, reg, source, expected, actor)
        try:
            version, created = await self.catalog.register(
                reg.id,
                source,
                owner=reg.owner,
                sha256=reg.sha256,
                expected_base_digest=expected,
                activate=reg.activate,
                actor=actor,
                envelope=not self.dedicated.auto,  # --auto-promote: outside it, tier dedicated, merged on first use
            )
            return version.key, created
        except (AdapterBaseMismatchError, AdapterBaseUnknownError):
            if not engines.several or expected is not None:
                raise
            for side in engines.engines[1:]:
                try:
                    return await self._add_on(side, reg, source, None, actor)
                except (AdapterBaseMismatchError, AdapterBaseUnknownError):
                    continue
            raise

    async def _add_on(
        self, side: Engine, reg: Registration, source: str, expected_base_digest: str | None, actor: str
    ) -> tuple[str, bool]:
        """Register on another base's engine: checked there, stored in the primary's registry, mirrored."""
        prepared = await side.admin.catalog.preparer.prepare(
            source, sha256=reg.sha256, expected_base_digest=expected_base_digest, owner=reg.owner
        )
        version, created = await self.catalog.add_prepared(
            reg.id, prepared, owner=reg.owner, activate=reg.activate, actor=actor
        )
        self.engines.sync()
        return version.key, created

    def key_for(self, name: str, action: str) -> str:
        return self.catalog.resolve_version(self.engines.on_primary(name, action))

    def check_removable(self, name: str, keys: list[str]) -> None:
        """409 while the id has a merged engine (demote it first); an engine refuses a busy version's delete itself."""
        promotion = self.dedicated.promotions.get(parse_name(name)[0])
        if promotion is not None and promotion.state != "failed" and promotion.key in keys:
            raise ConflictError(
                f"adapter {promotion.key!r} has a dedicated deployment ({promotion.state}); demote it first "
                f"(POST /v1/adapters/{promotion.adapter_id}/demote)",
                param="id",
            )

    async def check_pin(self, key: str) -> None:
        return None  # the catalog checks the bounds as it commits the pin, under its lock

    async def make_resident(self, key: str) -> None:
        await self.admin.make_resident(key)

    async def drop(self, key: str, actor: str) -> None:
        await self.admin.unload(key, actor=actor)

    def check_prompts_stored(self, stored: CheckPrompts) -> None:
        self.local.sampler.set_enabled(stored.adapter_id, stored.sample)  # sampled from its traffic from now on, or not

    def internal_state(self) -> dict[str, Any]:
        state = self.state
        server = {
            "requests_in_flight": len(state.request_ids),
            "in_flight_by_adapter": {k or "none": v for k, v in state.in_flight.items()},
            "draining_adapters": sorted(state.draining),
            "closing": state.closing,
        }
        body: dict[str, Any] = {"engine": self.local.engine.stats(), "server": server}
        if self.dedicated.promotions:  # the merged engines beside the shared one
            body["dedicated"] = {i: p.out() for i, p in sorted(self.dedicated.promotions.items())}
        if self.engines.several:  # every base's engine, the primary's included
            body["bases"] = {e.base_name: e.stats() for e in self.engines.engines}
        return body

    # -- the dedicated tier's routes (the fleet's) ------------------------------------------------

    def add_routes(self, app: web.Application, routes: AdminRoutes) -> None:
        """Promote and demote (the admin key only), answered as the shared admin routes answer."""

        async def promote(request: web.Request) -> web.Response:
            """Start a merged engine of ``id``'s version (``id``: its current one) beside the shared
            one, checked before it takes traffic: 202 with the adapter (``dedicated.state``
            ``starting``; ``GET`` shows ``merged`` once it serves, or ``failed`` and why). 409 when
            the id has one already."""
            actor = self.state.access.admin_actor(request)
            key = self.catalog.row(request.match_info["id"]).key
            check_promotable(self.local.engine, key)
            if key in self.state.draining:
                raise ConflictError(f"adapter {key!r} is being deleted; it is not promoted", param="id")
            self.dedicated.promote(key, actor)
            return await routes.describe(request, key, status=202)

        async def demote(request: web.Request) -> web.Response:
            """Route the id back to the shared engine and close its merged engine once its
            requests end; 409 unless it has one serving."""
            actor = self.state.access.admin_actor(request)
            adapter_id = request.match_info["id"]
            known_id(adapter_id, set(self.catalog.index.ids()))
            promotion = await self.dedicated.demote(adapter_id, actor)
            return await routes.describe(request, promotion.key)

        app.router.add_post("/v1/adapters/{id}/promote", promote)
        app.router.add_post("/v1/adapters/{id}/demote", demote)

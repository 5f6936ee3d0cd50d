"""The fleet's admin routes: those of ``lorapage serve`` (:mod:`lorapage.server.admin`), fleet-wide.

The ingress holds the fleet's registry (:mod:`lorapage.fleet.registry`) and answers from it;
what needs an engine goes to one replica through the adapter-affinity router, so it lands on
the adapter's owner: a registration is fetched and checked there (then committed here, answered
201, and servable on every replica at once, since a replica that meets a version it lacks syncs
first), a pre-warm loads it there. What every replica must do follows the registry through the
replicas' heartbeats (within ``sync_period_s``): a pin holds the version resident on **every**
replica (bounded on each by ``--max-pinned-fraction``; the pin is checked and loaded on the
owner before it is answered), an unload drops it from every pool, a delete drops it everywhere
once its requests end. The ingress sees every request, so its own counts decide a delete's
drain, exactly as on one server. Promotion and demotion start and remove an adapter's dedicated
merged deployment (:mod:`lorapage.fleet.dedicated`); an adapter outside the shared envelope
registers (tier ``dedicated``) and is served once promoted.

Every change is audited in the registry as the admin key's id (``actor``:
:meth:`~lorapage.server.auth.Access.admin_actor`), and ``GET /v1/audit`` reads the trail back
with ``lorapage serve``'s filters and answer (:func:`~lorapage.server.audit_route.audit_list`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from lorapage.adapters.cache import AdapterInfo
from lorapage.adapters.catalog import PreparedVersion
from lorapage.adapters.drift_state import CHECK_PROMPTS_BODY_BYTES, check_prompts_param
from lorapage.adapters.registry import VersionRow, parse_name
from lorapage.adapters.sources import AdapterRoots
from lorapage.adapters.tiers import Tier
from lorapage.errors import AdapterNotFoundError, ConflictError, InvalidRequestError, LorapageError
from lorapage.fleet.dedicated import DedicatedDeployments, PromotionOut
from lorapage.fleet.messages import EngineProfile
from lorapage.fleet.registry import FleetRegistry
from lorapage.fleet.telemetry import ReplicaReports
from lorapage.server import protocol
from lorapage.server.admin import cost_fields, known_id, read_admin_body, remove_when_idle, wait_until
from lorapage.server.audit_route import audit_list, history_body, history_limit
from lorapage.server.auth import Access, bearer_key
from lorapage.server.check_prompts import check_prompts_body, store_check_prompts
from lorapage.server.lora_admin import lora_not_found, lora_registration, lora_success_text, lora_unload_name
from lorapage.server.registration import Registration, checked_source, registration, source_errors
from lorapage.server.responses import AdapterOut, AdapterVersionOut
from lorapage.server.tenants import key_id

T = TypeVar("T")
Handler = Callable[[web.Request, str], Awaitable[web.Response]]  # a route's handler, given the adapter named
_TIER_ORDER = ("gpu", "ram")  # the best tier of any replica is the adapter's tier


class FleetAdapterOut(AdapterOut):
    """An adapter as the fleet's admin routes describe it: also where it is on each replica."""

    replicas: dict[str, str] = msgspec.field(default_factory=dict)  # replica id -> gpu | ram
    dedicated: PromotionOut | None = None  # its dedicated merged deployment (POST .../promote), if any


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


def _ok(got: T | LorapageError) -> T:
    """A replica's answer, or the refusal it returned raised here."""
    if isinstance(got, LorapageError):
        raise got
    return got


class FleetAdmin:
    """The admin handlers over the ingress's state (passed in: this module does not import the ingress)."""

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
    ) -> None:
        self.access, self.registry, self.engines, self.reports = access, registry, engines, reports
        self.dedicated = dedicated
        self.profile, self.in_flight, self.draining = profile, in_flight, draining
        self.adapter_roots, self.sync_period_s = adapter_roots, sync_period_s
        self._writes = asyncio.Lock()  # one registry change at a time, each committed in a worker

    def add_routes(self, app: web.Application) -> None:
        """The fleet's admin routes on ``app``: ``lorapage serve``'s paths, and promote / demote.
        A handler gets the adapter the path names ("" when none; a channel's route names it as its
        model name does, ``id@channel``); all but the four a tenant may call on its own adapters
        (:meth:`open_to_tenants`) take the admin key first."""
        add = app.router.add_route
        routes: list[tuple[str, str, Handler]] = [
            ("POST", "/v1/adapters", self.register),
            ("GET", "/v1/adapters", self.list),
            ("GET", "/v1/adapters/{id}", self.get),
            ("DELETE", "/v1/adapters/{id}", self.delete),
            ("GET", "/v1/adapters/{id}/versions", self.versions),
            ("PUT", "/v1/adapters/{id}/current", self.set_current),
            ("POST", "/v1/adapters/{id}/rollback", self.rollback),
            ("PUT", "/v1/adapters/{id}/channels/{channel}", self.set_channel),
            ("DELETE", "/v1/adapters/{id}/channels/{channel}", self.delete_channel),
            ("GET", "/v1/adapters/{id}/history", self.history),
            ("PUT", "/v1/adapters/{id}/check_prompts", self.put_check_prompts),
            ("GET", "/v1/adapters/{id}/check_prompts", self.get_check_prompts),
            ("PUT", "/v1/adapters/{id}/pin", self.pin),
            ("DELETE", "/v1/adapters/{id}/pin", self.unpin),
            ("POST", "/v1/adapters/{id}/promote", self.promote),
            ("POST", "/v1/adapters/{id}/demote", self.demote),
            ("POST", "/internal/adapters/{id}/load", self.load),
            ("POST", "/internal/adapters/{id}/unload", self.unload),
            ("GET", "/internal/state", self.internal_state),
            ("POST", "/v1/load_lora_adapter", self.load_lora),
            ("POST", "/v1/unload_lora_adapter", self.unload_lora),
            ("GET", "/v1/audit", self.audit),
        ]
        for method, path, handler in routes:
            add(method, path, self._route(handler))

    def _route(self, handler: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
        admin_only = not self.open_to_tenants(handler)

        async def route(request: web.Request) -> web.Response:
            if admin_only:
                self.access.require_admin(request)
            info = request.match_info
            name = "@".join(info[k] for k in ("id", "channel") if k in info)
            return await handler(request, name)

        return route

    def _actor(self, request: web.Request) -> str:
        """The admin key's id, which the audit rows of this request's changes name."""
        return self.access.admin_actor(request)  # it reads only the headers

    async def _write(self, change: Callable[[], T]) -> T:
        async with self._writes:
            return await asyncio.to_thread(change)

    def _on_owner(self, name: str) -> Any:
        """The replica handle routed like a request for ``name``'s adapter (to its owner)."""
        return self.engines.options(multiplexed_model_id=parse_name(name)[0])

    async def _resolve(self, name: str) -> str:
        return self.registry.resolve(name, self.profile.base_digest)

    # -- describing -------------------------------------------------------------------------------

    async def _describe(self, keys: list[str]) -> list[FleetAdapterOut]:
        infos = await self.engines.describe.remote(keys) if keys else []
        base = self.profile
        return [self._out(k, _ok(info), base) for k, info in zip(keys, infos, strict=True)]

    def _out(self, key: str, info: AdapterInfo, base: EngineProfile) -> FleetAdapterOut:
        adapter_id, version = parse_name(key)
        row = self.registry.row(key)
        assert row is not None and version is not None, key
        replicas = self.reports.tiers(key)
        tier = next((t for t in _TIER_ORDER if t in replicas.values()), "disk")
        promotion = self.dedicated.get(adapter_id)
        return FleetAdapterOut(
            id=adapter_id,
            owner=self.registry.owner(adapter_id),
            parent=base.base_name,
            path=info.path,
            rank=info.rank,
            target_modules=list(info.target_modules),
            size_bytes=info.size_bytes,
            num_params=info.num_params,
            tier=tier,
            in_flight=self.in_flight.get(key, 0),
            pinned=row.pinned,
            version=version,
            current=self.registry.current(adapter_id),
            digest=row.digest,
            source=row.source,
            base_digest=base.base_digest,
            versions=[r.version for r in self.registry.versions(adapter_id)],
            replicas=replicas,
            dedicated=promotion.out() if promotion is not None else None,
            # merged: this version is served by its dedicated deployment (the only tier the fleet judges)
            traffic_tier=Tier.MERGED.value if self.dedicated.route(key) is not None else None,
            **cost_fields(info),
        )

    # -- routes -----------------------------------------------------------------------------------

    async def register(self, request: web.Request, _: str) -> web.Response:
        """A new version of ``id`` (201), or the existing version with the same content (200)."""
        body = await read_admin_body(request)  # bounded first, before any replica is asked
        base = self.profile
        reg = registration(body, base.base_name, self.access)
        actor = self._actor(request)
        row, created = await self._register(reg, actor)
        if reg.check_prompts is not None or reg.sample_check_prompts is not None:  # kept for a base upgrade
            await store_check_prompts(
                self.registry.registry, reg.id, reg.check_prompts, reg.sample_check_prompts, None, actor
            )
        return _json((await self._describe([row.key]))[0], status=201 if created else 200)

    async def _register(self, reg: Registration, actor: str) -> tuple[VersionRow, bool]:
        """Fetched and checked on the id's owner replica, then committed here."""
        self.registry.check_owner(reg.id, reg.owner)
        with source_errors(reg):
            source = await checked_source(reg, self.adapter_roots, self.access)
            # envelope off: an adapter outside it registers with tier dedicated, its requests refused
            # (the envelope's 400) until it is promoted to a dedicated deployment of its own.
            got = self._on_owner(reg.id).prepare_adapter.remote(
                source, reg.sha256, reg.expected_base_digest, reg.owner, False
            )
            prepared: PreparedVersion = _ok(await got)
        row, created = await self._write(
            lambda: self.registry.add(reg.id, reg.owner, prepared, activate=reg.activate, actor=actor)
        )
        if reg.owner is not None:
            self.access.set_owner(reg.id, reg.owner)
        return row, created

    async def load_lora(self, request: web.Request, _: str) -> web.Response:
        """vLLM's ``POST /v1/load_lora_adapter``: a registration (:mod:`lorapage.server.lora_admin`)."""
        body = await read_admin_body(request)
        base = self.profile
        reg = lora_registration(body, base.base_name, self.access, self.registry.ids())
        await self._register(reg, self._actor(request))
        return web.Response(text=lora_success_text(reg.id, "added"))

    async def unload_lora(self, request: web.Request, _: str) -> web.Response:
        """vLLM's ``POST /v1/unload_lora_adapter``: every version of the id deleted, draining."""
        name = lora_unload_name(await read_admin_body(request))
        with lora_not_found(name):
            await self._delete(name, {"drain": "true"}, self._actor(request))
        return web.Response(text=lora_success_text(name, "removed"))

    async def list(self, request: web.Request, _: str) -> web.Response:
        base = self.profile.base_digest
        rows = [row for i in self.registry.ids() if (row := self.registry.row(i)) is not None]
        return _json({"object": "list", "data": await self._describe([r.key for r in rows if r.base_digest == base])})

    async def get(self, request: web.Request, name: str) -> web.Response:
        """As ``lorapage serve``'s: the admin reads any adapter; its owner's key its own, without
        where the operator keeps the files; any other key gets the 404 of one that does not exist."""
        admin = self.access.adapter_reader(request, name)  # it reads only the headers
        out = (await self._describe([await self._resolve(name)]))[0]
        if not admin:
            out.path = out.source = ""
        return _json(out)

    def open_to_tenants(self, handler: Handler) -> bool:
        """Whether ``handler`` checks its own key (a tenant may call it); the rest need the admin key."""
        return handler in (self.get, self.history, self.put_check_prompts, self.get_check_prompts)

    async def versions(self, request: web.Request, adapter_id: str) -> web.Response:
        """Every version of an id, servable on the fleet's base or not, oldest first."""
        rows = self.registry.versions(adapter_id)
        if "@" in adapter_id or not rows:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist", param="id")
        base, current = self.profile.base_digest, self.registry.current(adapter_id)
        return _json({"object": "list", "data": [self._version_out(r, base, current) for r in rows]})

    def _version_out(self, row: VersionRow, base: str, current: int | None) -> AdapterVersionOut:
        return AdapterVersionOut(
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

    async def set_current(self, request: web.Request, adapter_id: str) -> web.Response:
        """Deploy or roll back, fleet-wide at once: the ingress resolves every request's version."""
        req = protocol.decode(await read_admin_body(request), protocol.AdapterAliasRequest)
        known_id(adapter_id, self.registry.ids())
        row = self.registry.row(f"{adapter_id}@{req.version}")
        if row is not None:
            await self._resolve(row.key)  # a version on another base: 409 before the alias moves
        actor = self._actor(request)
        row = await self._write(lambda: self.registry.set_current(adapter_id, req.version, actor=actor))
        return _json((await self._describe([row.key]))[0])

    async def rollback(self, request: web.Request, adapter_id: str) -> web.Response:
        """As ``lorapage serve``'s: with no body (or no ``version``) back to the version the alias (or
        ``channel``) served before its last deploy; again, one deploy further back."""
        body = await read_admin_body(request)
        req = protocol.decode(body, protocol.RollbackRequest) if body.strip() else protocol.RollbackRequest()
        known_id(adapter_id, self.registry.ids())
        if req.version is not None and (row := self.registry.row(f"{adapter_id}@{req.version}")) is not None:
            await self._resolve(row.key)  # a version on another base: 409 before the alias moves
        servable = await self._servable(adapter_id)
        actor, channel = self._actor(request), req.channel or ""
        await self._write(lambda: self.registry.rollback(adapter_id, req.version, channel, servable, actor=actor))
        key = await self._resolve(f"{adapter_id}@{channel}" if channel else adapter_id)
        return _json((await self._describe([key]))[0])

    async def _servable(self, adapter_id: str) -> set[int]:
        """The versions of ``adapter_id`` a request could be served on (trained on a base the fleet runs)."""
        served = set()
        for row in self.registry.versions(adapter_id):
            try:
                await self._resolve(row.key)
            except LorapageError:
                continue
            served.add(row.version)
        return served

    async def set_channel(self, request: web.Request, name: str) -> web.Response:
        """Point the named channel ``id@{channel}`` at a version (created on first use): a deploy of
        that channel alone; the id's own alias stays where it is."""
        adapter_id, _, channel = name.partition("@")
        req = protocol.decode(await read_admin_body(request), protocol.AdapterAliasRequest)
        if (row := self.registry.row(f"{adapter_id}@{req.version}")) is not None:
            await self._resolve(row.key)  # a version on another base: 409 before the channel moves
        actor = self._actor(request)
        await self._write(lambda: self.registry.set_channel(adapter_id, channel, req.version, actor=actor))
        return _json((await self._describe([await self._resolve(name)]))[0])

    async def delete_channel(self, request: web.Request, name: str) -> web.Response:
        """Forget a named channel: ``id@{channel}`` names nothing from now on (404)."""
        adapter_id, _, channel = name.partition("@")
        actor = self._actor(request)
        await self._write(lambda: self.registry.set_channel(adapter_id, channel, None, action="channel", actor=actor))
        return _json({"id": name, "object": "adapter.channel", "deleted": True})

    async def history(self, request: web.Request, adapter_id: str) -> web.Response:
        """As ``lorapage serve``'s: the id's alias and channel moves, newest first; the admin sees any
        id (with the actors), its owner's key its own, any other key the 404 of an id that does not exist."""
        admin = self.access.adapter_reader(request, adapter_id)
        limit = history_limit(request.query)
        known_id(adapter_id, self.registry.ids())
        moves = await asyncio.to_thread(self.registry.history, adapter_id, limit + 1)
        current, channels = self.registry.current(adapter_id), self.registry.channels(adapter_id)
        return _json(history_body(adapter_id, moves, limit, current, channels, admin=admin))

    async def put_check_prompts(self, request: web.Request, adapter_id: str) -> web.Response:
        """As ``lorapage serve``'s (the admin, or the owner's key): what is given replaces what is
        stored. The fleet's promotion check runs them; a base upgrade's drift check runs where the
        base-migration routes are (``lorapage serve``). The ingress samples no traffic: ``sample``
        true is refused."""
        self._owned(request, adapter_id)
        req = protocol.decode(await read_admin_body(request, CHECK_PROMPTS_BODY_BYTES), protocol.CheckPromptsRequest)
        if req.sample:
            raise InvalidRequestError(
                "a fleet keeps no sample of an adapter's traffic; give the check prompts as 'prompts'", param="sample"
            )
        prompts = check_prompts_param(req.prompts, "prompts") if req.prompts is not None else None
        actor = key_id(bearer_key(request) or "")
        stored = await store_check_prompts(self.registry.registry, adapter_id, prompts, req.sample, req.opt_out, actor)
        return _json(check_prompts_body(stored))

    async def get_check_prompts(self, request: web.Request, adapter_id: str) -> web.Response:
        self._owned(request, adapter_id)
        return _json(check_prompts_body(await asyncio.to_thread(self.registry.registry.check_prompts, adapter_id)))

    def _owned(self, request: web.Request, adapter_id: str) -> None:
        """404 unless ``adapter_id`` is a registered id the caller may read (the admin, or its owner's key)."""
        self.access.adapter_reader(request, adapter_id)
        known_id(adapter_id, self.registry.ids())

    async def delete(self, request: web.Request, name: str) -> web.Response:
        """Delete ``id@N`` or ``id``: refused (409) while requests run, or with ``?drain=true``
        hidden from new requests until the running ones end."""
        running = await self._delete(name, request.query, self._actor(request))
        return _json({"id": name, "object": "adapter", "deleted": True, "drained_requests": running})

    async def _delete(self, name: str, query: Mapping[str, str], actor: str) -> int:
        keys = self.registry.removable(name)
        promotion = self.dedicated.get(parse_name(name)[0])
        if promotion is not None and promotion.state != "failed" and promotion.key in keys:
            raise ConflictError(
                f"adapter {promotion.key!r} has a dedicated deployment ({promotion.state}); demote it first "
                f"(POST /v1/adapters/{promotion.adapter_id}/demote)",
                param="id",
            )

        async def remove() -> None:
            await self._write(lambda: self.registry.remove(self.registry.removable(name), actor=actor))

        running = await remove_when_idle(name, keys, query, self.in_flight, self.draining, remove)
        adapter_id, _ = parse_name(name)
        if adapter_id not in self.registry.ids():
            self.access.drop_owner(adapter_id)
        return running

    async def pin(self, request: web.Request, name: str) -> web.Response:
        """Pin a version resident on every replica: checked against the bounds and loaded on its
        owner before the answer, on the others within a heartbeat. 409 ``pin_limit_exceeded``
        past ``--max-pinned-fraction`` (every replica holds the same pins)."""
        key, actor = await self._resolve(name), self._actor(request)
        owner = self._on_owner(key)
        _ok(await owner.check_pin.remote(key))
        await self._write(lambda: self.registry.set_pinned(key, True, actor=actor))
        try:
            _ok(await owner.load_adapter.remote(key))
        except LorapageError as exc:
            undone = f"pin undone: its load failed ({exc.code})"  # as lorapage serve audits it
            await self._write(lambda: self.registry.set_pinned(key, False, actor=actor, outcome=undone))
            raise
        return _json((await self._describe([key]))[0])

    async def unpin(self, request: web.Request, name: str) -> web.Response:
        key, actor = await self._resolve(name), self._actor(request)
        await self._write(lambda: self.registry.set_pinned(key, False, actor=actor))
        return _json((await self._describe([key]))[0])

    async def load(self, request: web.Request, name: str) -> web.Response:
        """Pre-warm a version on the replica the router sends its requests to (an owner)."""
        key, actor = await self._resolve(name), self._actor(request)
        _ok(await self._on_owner(key).load_adapter.remote(key))
        adapter_id, version = parse_name(key)
        await self._write(lambda: self.registry.record("load", adapter_id, actor=actor, after={"version": version}))
        return _json((await self._describe([key]))[0])

    async def unload(self, request: web.Request, name: str) -> web.Response:
        """Drop a version from every replica's pool (not while it runs there, nor if pinned);
        answered once no replica reports it in its pool, or after a few heartbeats."""
        key, actor = await self._resolve(name), self._actor(request)
        await self._write(lambda: self.registry.unload(key, actor=actor))
        await wait_until(lambda: "gpu" not in self.reports.tiers(key).values(), 3 * self.sync_period_s)
        return _json((await self._describe([key]))[0])

    async def promote(self, request: web.Request, name: str) -> web.Response:
        """Start a dedicated deployment of ``name``'s version (``id``: its current one), merged
        into the base and checked before it takes traffic: 202 with the adapter (``dedicated.state``
        ``starting``; ``GET`` shows ``merged`` once it serves, or ``failed`` and why). 409 when
        the id has one already."""
        key = await self._resolve(name)
        if key in self.draining:  # a DELETE ?drain=true waits on it: a deployment would outlive the version
            raise ConflictError(f"adapter {key!r} is being deleted; it is not promoted", param="id")
        self.dedicated.promote(key, self._actor(request))
        return _json((await self._describe([key]))[0], status=202)

    async def demote(self, request: web.Request, adapter_id: str) -> web.Response:
        """Route the id back to the shared pool and delete its dedicated deployment; 409 unless it has one serving."""
        promoted = {adapter_id} if self.dedicated.get(adapter_id) is not None else set()  # deleted since: still demoted
        known_id(adapter_id, set(self.registry.ids()) | promoted)
        promotion = await self.dedicated.demote(adapter_id, self._actor(request))
        if self.registry.row(promotion.key) is None:  # the version was deleted while it was promoted
            return _json({"id": promotion.key, "object": "adapter", "dedicated": None})
        return _json((await self._describe([promotion.key]))[0])

    async def audit(self, request: web.Request, _: str) -> web.Response:
        """``GET /v1/audit``: the fleet registry's trail, as ``lorapage serve`` answers it."""
        return _json(await audit_list(request.query, lambda q: asyncio.to_thread(self.registry.audit, q)))

    async def internal_state(self, request: web.Request, _: str) -> web.Response:
        ingress = {
            "requests_in_flight": sum(self.in_flight.values()),
            "in_flight_by_adapter": {k or "none": v for k, v in self.in_flight.items() if v},
            "draining_adapters": sorted(self.draining),
            "registry_generation": self.registry.generation,
            "dedicated": {i: p.out() for i, p in sorted(self.dedicated.items())},
        }
        replicas = {rid: beat.stats for rid, beat in self.reports.live().items()}
        return _json({"ingress": ingress, "replicas": replicas})

"""Admin routes: register adapter versions, deploy and roll back (in one call: back through the
alias history), move named channels, inspect and delete them, pre-warm or drop them, read engine
state; vLLM's load and unload routes over the same operations. Each change is audited in the
registry as the admin key's id (:mod:`lorapage.adapters.audit`); the trail and the alias history
are read by :mod:`lorapage.server.audit_route`.

All of them take the admin key only, and a body of at most :data:`ADMIN_MAX_BODY_BYTES` (read
as it streams: nothing past the limit is read). What a registration may read, and from where, is
:mod:`lorapage.server.registration`'s rule. A version is answered 201 only once committed to the
registry, so it survives a restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import msgspec
from aiohttp import web

from lorapage.adapters.cache import AdapterInfo
from lorapage.adapters.registry import parse_name
from lorapage.errors import AdapterBusyError, AdapterNotFoundError, BodyTooLargeError, InvalidRequestError
from lorapage.server import protocol
from lorapage.server.check_prompts import store_check_prompts
from lorapage.server.lora_admin import lora_not_found, lora_registration, lora_success_text, lora_unload_name
from lorapage.server.registration import Registration, checked_source, registration, source_errors
from lorapage.server.responses import AdapterCostOut, AdapterOut, AdapterVersionOut, TrafficOut
from lorapage.server.state import ServeState

# An admin body is a few hundred bytes of JSON (an id, a tenant, a source URI, two digests).
ADMIN_MAX_BODY_BYTES = 64 << 10
TRAFFIC_HOURS = 24  # GET /v1/adapters/{id} shows this many hours of traffic (the one in progress included)


def check_body_length(length: int | None, limit: int) -> None:
    """Refuse (413) a body whose declared length is over ``limit``, before reading any of it."""
    if length is not None and length > limit:
        raise BodyTooLargeError(f"request body is {length} bytes; the limit is {limit}")


def body_too_large(limit: int) -> BodyTooLargeError:
    """The 413 for a body that streamed past ``limit`` (no length declared, or a wrong one)."""
    return BodyTooLargeError(f"request body is over the limit of {limit} bytes; reading stopped there")


async def read_admin_body(request: web.Request, limit: int = ADMIN_MAX_BODY_BYTES) -> bytes:
    """An admin route's body, read as it streams and refused (413) once past ``limit``: a body
    without a Content-Length (chunked) is never read whole first."""
    check_body_length(request.content_length, limit)
    chunks, size = [], 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def cost_fields(info: AdapterInfo) -> dict[str, Any]:
    """An adapter's projected cost and serving tier as the admin routes show them (here and in the fleet)."""
    cost = info.cost
    return {
        "projected_cost_pct": None if cost is None else cost.projected_cost_pct,
        "cost": None if cost is None else AdapterCostOut.of(cost),
        "serving_tier": info.serving_tier,
    }


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


class AdminRoutes:
    """Handlers bound to the server state (the state key is passed in to avoid an import cycle)."""

    def __init__(self, state_key: web.AppKey) -> None:
        self.key = state_key

    def _state(self, request: web.Request) -> ServeState:
        state = request.app[self.key]
        state.access.require_admin(request)
        return state

    def _admin(self, request: web.Request) -> tuple[ServeState, str]:
        """The server state and the admin key's id (the actor audit rows name)."""
        state = request.app[self.key]
        return state, state.access.admin_actor(request)

    def _describe(self, state: ServeState, name: str) -> AdapterOut:
        """``name`` (``id``: its current version, or ``id@N``) as the admin routes show it."""
        engine, name = state.backend.engines.serving(name)  # the engine of the base it runs on
        info = engine.admin.info(name)
        versions = state.backend.engine.admin.versions(info.adapter_id)
        current = next((v.version for v in versions if v.current), None)
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
            traffic_tier=info.traffic_tier,
            kept_hot=info.kept_hot,
            status="draining" if info.name in state.draining else info.status,
            **cost_fields(info),
        )

    async def register(self, request: web.Request) -> web.Response:
        """A new version of ``id`` (201), or the existing version with the same content (200)."""
        state, actor = self._admin(request)
        reg = registration(await read_admin_body(request), state.backend.engine.base_name, state.access)
        info = await self._register(state, reg, actor)
        if reg.check_prompts is not None or reg.sample_check_prompts is not None:
            stored = await store_check_prompts(
                state.backend.engine.admin.registry, reg.id, reg.check_prompts, reg.sample_check_prompts, None, actor
            )
            state.backend.sampler.set_enabled(reg.id, stored.sample)
        return _json(self._describe(state, info.name), status=201 if info.created else 200)

    async def _register(self, state: ServeState, reg: Registration, actor: str) -> AdapterInfo:
        with source_errors(reg):
            source = await checked_source(reg, state.backend.engine.admin.roots, state.access)
            info = await state.backend.engines.register(
                reg.id,
                source,
                owner=reg.owner,
                sha256=reg.sha256,
                expected_base_digest=reg.expected_base_digest,
                activate=reg.activate,
                actor=actor,
            )
        if reg.owner is not None:
            state.access.set_owner(reg.id, reg.owner)
        return info

    async def load_lora(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/load_lora_adapter``: a registration (see :mod:`lorapage.server.lora_admin`)."""
        state, actor = self._admin(request)
        body = await read_admin_body(request)
        reg = lora_registration(body, state.backend.engine.base_name, state.access, state.backend.engine.admin.ids())
        await self._register(state, reg, actor)
        return web.Response(text=lora_success_text(reg.id, "added"))

    async def unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/unload_lora_adapter``: a delete that drains (every version of the id)."""
        state, actor = self._admin(request)
        name = lora_unload_name(await read_admin_body(request))
        with lora_not_found(name):
            await self._delete(state, name, {"drain": "true"}, actor)
        return web.Response(text=lora_success_text(name, "removed"))

    async def list(self, request: web.Request) -> web.Response:
        state = self._state(request)
        return _json(
            {"object": "list", "data": [self._describe(state, i.name) for i in state.backend.engine.admin.served()]}
        )

    async def get(self, request: web.Request) -> web.Response:
        """One adapter (``id``: its current version, or ``id@N``) with its traffic tier and its
        last 24 hours of traffic. The admin sees any; a tenant key only the adapters registered
        for that tenant, and any other is answered as one that does not exist (404): shared
        adapters included, whose traffic is other tenants' too. A tenant is not shown where the
        operator keeps the files (``path``, ``source``)."""
        state = request.app[self.key]
        name = request.match_info["id"]
        admin = state.access.adapter_reader(request, name)
        out = self._describe(state, name)
        rows = await state.backend.engine.admin.traffic(out.id, TRAFFIC_HOURS)
        first_hour = int(state.backend.engine.admin.wall_clock() // 3600) - TRAFFIC_HOURS + 1
        out.traffic = TrafficOut.of([r for r in rows if r.version == out.version], first_hour)
        if not admin:
            out.path = out.source = ""
        return _json(out)

    async def versions(self, request: web.Request) -> web.Response:
        """Every version of an id, servable on this base or not, oldest first."""
        state = self._state(request)
        adapter_id = request.match_info["id"]
        versions = state.backend.engine.admin.versions(adapter_id)
        if not versions:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist", param="id")
        data = [
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
                in_flight=state.in_flight.get(v.key, 0),
                projected_cost_pct=v.projected_cost_pct,
            )
            for v in sorted(versions, key=lambda v: v.version)
        ]
        return _json({"object": "list", "data": data})

    async def set_current(self, request: web.Request) -> web.Response:
        """Deploy (or roll back to a version named): point the id at another version, atomically.
        Requests in flight finish on the version they started with; new ones get this one."""
        state, actor = self._admin(request)
        adapter_id = request.match_info["id"]
        req = protocol.decode(await read_admin_body(request), protocol.AdapterAliasRequest)
        info = await state.backend.engine.admin.deploy(_known_id(state, adapter_id), req.version, actor=actor)
        return _json(self._describe(state, info.name))

    async def rollback(self, request: web.Request) -> web.Response:
        """Roll back in one call: with no body (or no ``version``) to the version the alias (or
        ``channel``) served before its last deploy; again, one deploy further back."""
        state, actor = self._admin(request)
        adapter_id = _known_id(state, request.match_info["id"])
        body = await read_admin_body(request)
        req = protocol.decode(body, protocol.RollbackRequest) if body.strip() else protocol.RollbackRequest()
        info = await state.backend.engine.admin.rollback(
            adapter_id, req.version, channel=req.channel or "", actor=actor
        )
        name = f"{adapter_id}@{req.channel}" if req.channel else info.name
        return _json(self._describe(state, name))

    async def set_channel(self, request: web.Request) -> web.Response:
        """Point the named channel ``id@{channel}`` at a version (created on first use): a deploy
        of that channel alone; the id's own alias stays where it is."""
        state, actor = self._admin(request)
        adapter_id, channel = _known_id(state, request.match_info["id"]), request.match_info["channel"]
        req = protocol.decode(await read_admin_body(request), protocol.AdapterAliasRequest)
        await state.backend.engine.admin.deploy(adapter_id, req.version, channel=channel, actor=actor)
        return _json(self._describe(state, f"{adapter_id}@{channel}"))

    async def delete_channel(self, request: web.Request) -> web.Response:
        """Forget a named channel: ``id@{channel}`` names nothing from now on (404)."""
        state, actor = self._admin(request)
        adapter_id, channel = _known_id(state, request.match_info["id"]), request.match_info["channel"]
        await state.backend.engine.admin.remove_channel(adapter_id, channel, actor=actor)
        return _json({"id": f"{adapter_id}@{channel}", "object": "adapter.channel", "deleted": True})

    async def delete(self, request: web.Request) -> web.Response:
        """Delete ``id@N`` (one version) or ``id`` (every version). Refused (409) while requests
        run, or with ``?drain=true`` hidden from new requests until the running ones end."""
        state, actor = self._admin(request)
        name = request.match_info["id"]
        running = await self._delete(state, name, request.query, actor)
        return _json({"id": name, "object": "adapter", "deleted": True, "drained_requests": running})

    async def _delete(self, state: ServeState, name: str, query: Mapping[str, str], actor: str) -> int:
        keys = state.backend.engine.admin.removable_versions(name)  # 404 when unknown, 409 for the current of several

        async def remove() -> None:
            state.backend.engine.admin.remove(name, actor=actor)  # 409 from the engine if it still holds requests

        running = await remove_when_idle(name, keys, query, state.in_flight, state.draining, remove)
        adapter_id, _ = parse_name(name)
        if adapter_id not in state.backend.engine.admin.ids():
            state.access.drop_owner(adapter_id)
        return running

    async def load(self, request: web.Request) -> web.Response:
        state, actor = self._admin(request)
        adapter = state.backend.engines.on_primary(request.match_info["id"], "load")
        await state.backend.engine.admin.load(adapter, actor=actor)
        return _json(self._describe(state, adapter))

    async def unload(self, request: web.Request) -> web.Response:
        state, actor = self._admin(request)
        adapter = state.backend.engines.on_primary(request.match_info["id"], "unload")
        await state.backend.engine.admin.unload(adapter, actor=actor)
        return _json(self._describe(state, adapter))

    async def pin(self, request: web.Request) -> web.Response:
        """Pin a version resident (``id``: its current one, or ``id@N``): loaded now, never
        evicted, pinned again after a restart. 409 ``pin_limit_exceeded`` with the numbers when
        pins would pass ``--max-pinned-fraction`` of the pool."""
        state, actor = self._admin(request)
        info = await state.backend.engine.admin.pin(
            state.backend.engines.on_primary(request.match_info["id"], "pin"), actor=actor
        )
        return _json(self._describe(state, info.name))

    async def unpin(self, request: web.Request) -> web.Response:
        """Undo a pin: the version stays resident, evictable again."""
        state, actor = self._admin(request)
        info = await state.backend.engine.admin.unpin(
            state.backend.engines.on_primary(request.match_info["id"], "unpin"), actor=actor
        )
        return _json(self._describe(state, info.name))

    async def internal_state(self, request: web.Request) -> web.Response:
        state = self._state(request)
        server = {
            "requests_in_flight": len(state.request_ids),
            "in_flight_by_adapter": {k or "none": v for k, v in state.in_flight.items()},
            "draining_adapters": sorted(state.draining),
            "closing": state.closing,
        }
        body: dict[str, Any] = {"engine": state.backend.engine.stats(), "server": server}
        if state.backend.engines.several:  # every base's engine, the primary's included
            body["bases"] = {e.base_name: e.stats() for e in state.backend.engines.engines}
        return _json(body)


def _known_id(state: ServeState, adapter_id: str) -> str:
    return known_id(adapter_id, state.backend.engine.admin.ids())


def known_id(adapter_id: str, ids: Collection[str]) -> str:
    """``adapter_id`` when it is one of ``ids`` (ids with versions): 404 for a version's or a
    channel's name, or an id nobody registered (``lorapage serve``'s admin routes and the fleet's)."""
    if "@" in adapter_id or adapter_id not in ids:
        raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist; name the id, not a version", param="id")
    return adapter_id


def _drain_timeout(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise InvalidRequestError(f"timeout must be seconds between 0 and 3600; got {raw!r}", param="timeout")
    return value


async def remove_when_idle(
    name: str,
    keys: list[str],
    query: Mapping[str, str],
    in_flight: Mapping[str | None, int],
    draining: set[str],
    remove: Callable[[], Awaitable[None]],
) -> int:
    """Delete ``name`` (its versions ``keys``) by ``remove()``, which raises AdapterBusyError
    while an engine still holds requests for them. With requests in flight: 409, or with
    ``?drain=true`` the versions are hidden from new requests (``draining``) and removed once
    none runs, within ``?timeout`` seconds (else 409 and they serve again). Returns the requests
    that were drained. Shared by ``lorapage serve`` and the fleet's ingress."""
    drain = query.get("drain", "false").lower() in ("1", "true", "yes")
    timeout = _drain_timeout(query.get("timeout", "60"))
    running = sum(in_flight.get(k, 0) for k in keys)
    if running and not drain:
        raise AdapterBusyError(
            f"adapter {name!r} has {running} requests in flight; retry when they finish, or DELETE "
            "with ?drain=true to refuse new requests and remove it once they end",
            param="id",
        )
    if not running:
        await remove()
        return 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    draining.update(keys)
    try:
        while True:
            if not any(in_flight.get(k, 0) for k in keys):
                try:
                    await remove()
                    return running
                except AdapterBusyError:
                    pass  # the engine lets go of a finished request within a step
            if loop.time() >= deadline:
                left = sum(in_flight.get(k, 0) for k in keys)
                raise AdapterBusyError(
                    f"adapter {name!r} still had {left} requests in flight after draining for "
                    f"{timeout:g}s; it was not deleted and serves again",
                    param="id",
                )
            await asyncio.sleep(0.05)
    finally:
        draining.difference_update(keys)


async def wait_until(done: Callable[[], bool], timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def add_admin_routes(app: web.Application, state_key: web.AppKey) -> None:
    routes = AdminRoutes(state_key)
    app.router.add_post("/v1/adapters", routes.register)
    app.router.add_get("/v1/adapters", routes.list)
    app.router.add_get("/v1/adapters/{id}", routes.get)
    app.router.add_delete("/v1/adapters/{id}", routes.delete)
    app.router.add_get("/v1/adapters/{id}/versions", routes.versions)
    app.router.add_put("/v1/adapters/{id}/current", routes.set_current)
    app.router.add_post("/v1/adapters/{id}/rollback", routes.rollback)
    app.router.add_put("/v1/adapters/{id}/channels/{channel}", routes.set_channel)
    app.router.add_delete("/v1/adapters/{id}/channels/{channel}", routes.delete_channel)
    app.router.add_put("/v1/adapters/{id}/pin", routes.pin)
    app.router.add_delete("/v1/adapters/{id}/pin", routes.unpin)
    app.router.add_post("/internal/adapters/{id}/load", routes.load)
    app.router.add_post("/internal/adapters/{id}/unload", routes.unload)
    app.router.add_get("/internal/state", routes.internal_state)
    app.router.add_post("/v1/load_lora_adapter", routes.load_lora)
    app.router.add_post("/v1/unload_lora_adapter", routes.unload_lora)

"""Admin routes: register adapter versions, deploy and roll back (in one call: back through the
alias history), move named channels, inspect and delete them, pre-warm or drop them, read engine
state; vLLM's load and unload routes over the same operations. Each change is audited in the
registry as the admin key's id (:mod:`lorapage.registry.audit`); the trail and the alias history
are read by :mod:`lorapage.frontend.audit_route`.

``lorapage serve`` and the fleet's ingress serve these routes alike; what a change does is the
app's :class:`~lorapage.frontend.admin_ops.Admin` (the engines here, or the fleet's registry and
replicas). All of them take the admin key only (reading one adapter and its check prompts: its
owner's key too), and a body of at most :data:`ADMIN_MAX_BODY_BYTES` (read as it streams:
nothing past the limit is read). What a registration may read, and from where, is
:mod:`lorapage.frontend.registration`'s rule. A version is answered 201 only once committed to the
registry, so it survives a restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from aiohttp import web

from lorapage.adapters.cache import AdapterInfo
from lorapage.adapters.names import parse_name
from lorapage.errors import AdapterBusyError, AdapterNotFoundError, InvalidRequestError
from lorapage.frontend import protocol
from lorapage.frontend.admin_ops import ADMIN, Admin
from lorapage.frontend.auth import bearer_key
from lorapage.frontend.bodies import json_response, read_admin_body
from lorapage.frontend.caller import adapter_reader
from lorapage.frontend.check_prompts import check_prompts_body, owned_id
from lorapage.frontend.lora_admin import lora_not_found, lora_registration, lora_success_text, lora_unload_name
from lorapage.frontend.registration import Registration, checked_source, registration, source_errors
from lorapage.frontend.responses import AdapterCostOut
from lorapage.frontend.state import STATE, ServerState
from lorapage.registry.drift_state import CHECK_PROMPTS_BODY_BYTES, check_prompts_param
from lorapage.tenancy.tenants import key_id


def cost_fields(info: AdapterInfo) -> dict[str, Any]:
    """An adapter's projected cost and serving tier as the admin routes show them (here and in the fleet)."""
    cost = info.cost
    return {
        "projected_cost_pct": None if cost is None else cost.projected_cost_pct,
        "cost": None if cost is None else AdapterCostOut.of(cost),
        "serving_tier": info.serving_tier,
    }


def check_sampling(ops: Admin, sample: bool | None, param: str) -> None:
    """400 for an owner's choice to sample check prompts from traffic where nothing samples it (a fleet's ingress)."""
    if sample and not ops.deployment.samples_traffic:
        raise InvalidRequestError(
            "this deployment keeps no sample of an adapter's traffic; give the check prompts themselves", param=param
        )


class AdminRoutes:
    """Handlers over the front end's state and the app's :class:`~lorapage.frontend.admin_ops.Admin`."""

    def _admin(self, request: web.Request) -> tuple[ServerState[Any], Admin, str]:
        """The state, the operations and the admin key's id (the actor audit rows name); 401/403
        for any other key."""
        state = request.app[STATE]
        return state, request.app[ADMIN], state.access.admin_actor(request)

    async def describe(self, request: web.Request, name: str, status: int = 200) -> web.Response:
        """``name`` described, as every admin route answers."""
        return json_response((await request.app[ADMIN].deployment.describe([name]))[0], status=status)

    async def register(self, request: web.Request) -> web.Response:
        """A new version of ``id`` (201), or the existing version with the same content (200)."""
        state, ops, actor = self._admin(request)
        reg = registration(await read_admin_body(request), ops.deployment.base_name, state.access)
        check_sampling(ops, reg.sample_check_prompts, "sample_check_prompts")  # refused before anything is stored
        key, created = await self._register(state, ops, reg, actor)
        if reg.check_prompts is not None or reg.sample_check_prompts is not None:  # kept for a base upgrade
            await ops.store_check_prompts(reg.id, reg.check_prompts, reg.sample_check_prompts, None, actor)
        return await self.describe(request, key, status=201 if created else 200)

    async def _register(self, state: ServerState[Any], ops: Admin, reg: Registration, actor: str) -> tuple[str, bool]:
        with source_errors(reg):
            source = await checked_source(reg, ops.deployment.roots, state.access)
            key, created = await ops.register(reg, source, actor)
        if reg.owner is not None:
            state.access.set_owner(reg.id, reg.owner)
        return key, created

    async def load_lora(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/load_lora_adapter``: a registration (see :mod:`lorapage.frontend.lora_admin`)."""
        state, ops, actor = self._admin(request)
        body = await read_admin_body(request)
        reg = lora_registration(body, ops.deployment.base_name, state.access, ops.store.index.ids())
        await self._register(state, ops, reg, actor)
        return web.Response(text=lora_success_text(reg.id, "added"))

    async def unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/unload_lora_adapter``: a delete that drains (every version of the id)."""
        state, ops, actor = self._admin(request)
        name = lora_unload_name(await read_admin_body(request))
        with lora_not_found(name):
            await self._delete(state, ops, name, {"drain": "true"}, actor)
        return web.Response(text=lora_success_text(name, "removed"))

    async def list(self, request: web.Request) -> web.Response:
        _, ops, _ = self._admin(request)
        return json_response({"object": "list", "data": await ops.deployment.describe(ops.deployment.listed())})

    async def get(self, request: web.Request) -> web.Response:
        """One adapter (``id``: its current version, or ``id@N``) with its traffic tier and, where
        kept, its last 24 hours of traffic. The admin sees any; a tenant key only the adapters
        registered for that tenant, and any other is answered as one that does not exist (404):
        shared adapters included, whose traffic is other tenants' too. A tenant is not shown where
        the operator keeps the files (``path``, ``source``)."""
        state, ops = request.app[STATE], request.app[ADMIN]
        name = request.match_info["id"]
        admin = adapter_reader(state, request, name)
        out = (await ops.deployment.describe([name]))[0]
        out.traffic = await ops.deployment.traffic(out)
        if not admin:
            out.path = out.source = ""
        return json_response(out)

    async def versions(self, request: web.Request) -> web.Response:
        """Every version of an id, servable on a base served here or not, oldest first."""
        _, ops, _ = self._admin(request)
        adapter_id = request.match_info["id"]
        versions = ops.deployment.versions(adapter_id) if "@" not in adapter_id else []
        if not versions:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist", param="id")
        return json_response({"object": "list", "data": versions})

    async def set_current(self, request: web.Request) -> web.Response:
        """Deploy (or roll back to a version named): point the id at another version, atomically.
        Requests in flight finish on the version they started with; new ones get this one."""
        _, ops, actor = self._admin(request)
        adapter_id = known_id(request.match_info["id"], ops.store.index.ids())
        req = protocol.decode(await read_admin_body(request), protocol.AdapterAliasRequest)
        return await self.describe(request, await ops.deploy(adapter_id, req.version, "", actor))

    async def rollback(self, request: web.Request) -> web.Response:
        """Roll back in one call: with no body (or no ``version``) to the version the alias (or
        ``channel``) served before its last deploy; again, one deploy further back."""
        _, ops, actor = self._admin(request)
        adapter_id = known_id(request.match_info["id"], ops.store.index.ids())
        body = await read_admin_body(request)
        req = protocol.decode(body, protocol.RollbackRequest) if body.strip() else protocol.RollbackRequest()
        return await self.describe(request, await ops.rollback(adapter_id, req.version, req.channel or "", actor))

    async def set_channel(self, request: web.Request) -> web.Response:
        """Point the named channel ``id@{channel}`` at a version (created on first use): a deploy
        of that channel alone; the id's own alias stays where it is."""
        _, ops, actor = self._admin(request)
        adapter_id, channel = known_id(request.match_info["id"], ops.store.index.ids()), request.match_info["channel"]
        req = protocol.decode(await read_admin_body(request), protocol.AdapterAliasRequest)
        return await self.describe(request, await ops.deploy(adapter_id, req.version, channel, actor))

    async def delete_channel(self, request: web.Request) -> web.Response:
        """Forget a named channel: ``id@{channel}`` names nothing from now on (404)."""
        _, ops, actor = self._admin(request)
        adapter_id, channel = known_id(request.match_info["id"], ops.store.index.ids()), request.match_info["channel"]
        await ops.store.remove_channel(adapter_id, channel, actor=actor)
        return json_response({"id": f"{adapter_id}@{channel}", "object": "adapter.channel", "deleted": True})

    async def delete(self, request: web.Request) -> web.Response:
        """Delete ``id@N`` (one version) or ``id`` (every version). Refused (409) while requests
        run, or with ``?drain=true`` hidden from new requests until the running ones end."""
        state, ops, actor = self._admin(request)
        name = request.match_info["id"]
        running = await self._delete(state, ops, name, request.query, actor)
        return json_response({"id": name, "object": "adapter", "deleted": True, "drained_requests": running})

    async def _delete(
        self, state: ServerState[Any], ops: Admin, name: str, query: Mapping[str, str], actor: str
    ) -> int:
        keys = ops.removable(name)  # 404 when unknown, 409 for the current of several

        async def remove() -> None:
            ops.store.remove(name, actor=actor)  # 409 from an engine if it still holds requests

        running = await remove_when_idle(name, keys, query, state.in_flight, state.draining, remove)
        adapter_id, _ = parse_name(name)
        if adapter_id not in ops.store.index.ids():
            state.access.drop_owner(adapter_id)
        return running

    async def load(self, request: web.Request) -> web.Response:
        """Pre-warm a version (``id``: its current one, or ``id@N``)."""
        _, ops, actor = self._admin(request)
        return await self.describe(request, await ops.load(request.match_info["id"], actor))

    async def unload(self, request: web.Request) -> web.Response:
        """Drop a version from the pool (not while it runs, nor if pinned)."""
        _, ops, actor = self._admin(request)
        return await self.describe(request, await ops.unload(request.match_info["id"], actor))

    async def pin(self, request: web.Request) -> web.Response:
        """Pin a version resident (``id``: its current one, or ``id@N``): loaded now, never
        evicted, pinned again after a restart. 409 ``pin_limit_exceeded`` with the numbers when
        pins would pass ``--max-pinned-fraction`` of the pool."""
        _, ops, actor = self._admin(request)
        return await self.describe(request, await ops.pin(request.match_info["id"], actor))

    async def unpin(self, request: web.Request) -> web.Response:
        """Undo a pin: the version stays resident, evictable again."""
        _, ops, actor = self._admin(request)
        return await self.describe(request, await ops.unpin(request.match_info["id"], actor))

    async def internal_state(self, request: web.Request) -> web.Response:
        _, ops, _ = self._admin(request)
        return json_response(ops.deployment.internal_state())

    async def put_check_prompts(self, request: web.Request) -> web.Response:
        """Replace what is given of an adapter's check prompts and choices (the admin, or the
        owner's key; :mod:`lorapage.frontend.check_prompts`)."""
        state, ops = request.app[STATE], request.app[ADMIN]
        adapter_id = owned_id(state, ops.store.index.ids(), request)
        req = protocol.decode(await read_admin_body(request, CHECK_PROMPTS_BODY_BYTES), protocol.CheckPromptsRequest)
        prompts = check_prompts_param(req.prompts, "prompts") if req.prompts is not None else None
        check_sampling(ops, req.sample, "sample")
        key = bearer_key(request)
        assert key is not None
        return json_response(
            check_prompts_body(await ops.store_check_prompts(adapter_id, prompts, req.sample, req.opt_out, key_id(key)))
        )

    async def get_check_prompts(self, request: web.Request) -> web.Response:
        state, ops = request.app[STATE], request.app[ADMIN]
        adapter_id = owned_id(state, ops.store.index.ids(), request)
        return json_response(check_prompts_body(await ops.check_prompts(adapter_id)))


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


def add_admin_routes(app: web.Application, ops: Admin) -> AdminRoutes:
    """The admin routes over ``ops`` (``lorapage serve``'s and the fleet's alike); the side adds its
    own with the returned routes' helpers (the fleet: promote, demote)."""
    app[ADMIN] = ops
    routes = AdminRoutes()
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
    app.router.add_put("/v1/adapters/{id}/check_prompts", routes.put_check_prompts)
    app.router.add_get("/v1/adapters/{id}/check_prompts", routes.get_check_prompts)
    app.router.add_post("/internal/adapters/{id}/load", routes.load)
    app.router.add_post("/internal/adapters/{id}/unload", routes.unload)
    app.router.add_get("/internal/state", routes.internal_state)
    app.router.add_post("/v1/load_lora_adapter", routes.load_lora)
    app.router.add_post("/v1/unload_lora_adapter", routes.unload_lora)
    return routes

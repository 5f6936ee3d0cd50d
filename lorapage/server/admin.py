"""Admin routes: register, inspect and delete adapters, pre-warm or drop them, read engine state.

All of them take the admin key only. Registration is the one place where the server reads a path
named in a request: only for the admin, and only under the ``--adapter-root`` directories. The
path is resolved first (symlinks and ``..`` followed), and so is every file in the directory, so
neither the path nor a link inside it can reach outside a root. Without a root it is refused.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import msgspec
from aiohttp import web

from lorapage.errors import (
    AdapterBusyError,
    AdapterFormatError,
    ConflictError,
    InvalidRequestError,
    PermissionDeniedError,
)
from lorapage.server import protocol
from lorapage.server.responses import AdapterOut

_ADAPTER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RESERVED_IDS = ("none",)  # x-adapter-id of base-model requests


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


def _local_path(raw: str, roots: tuple[Path, ...]) -> Path:
    """The resolved directory a path or ``file://`` URI names, inside one of ``roots``; other
    schemes, paths outside the roots and directories holding links out of them are refused."""
    if "://" in raw:
        uri = urlparse(raw)
        if uri.scheme != "file":
            raise InvalidRequestError(
                f"path scheme {uri.scheme!r} is not supported; give a directory on the server or a file:// URI",
                param="path",
            )
        if uri.netloc not in ("", "localhost"):
            raise InvalidRequestError("file:// URIs must name a local path (file:///dir)", param="path")
        raw = unquote(uri.path)
    path = Path(raw)
    if not path.is_absolute():
        raise InvalidRequestError(f"path must be absolute; got {raw!r}", param="path")
    if not roots:
        raise PermissionDeniedError(
            "registering adapters from a path is disabled: start the server with --adapter-root DIR "
            "to allow adapter directories under DIR",
            param="path",
        )
    resolved = _resolve(path)
    root = next((r for r in roots if resolved.is_relative_to(r)), None)
    if root is None:
        shown = ", ".join(map(str, roots))
        raise PermissionDeniedError(
            f"adapter path {path} resolves to {resolved}, outside the adapter roots ({shown}); "
            "put the adapter under a root, or start the server with another --adapter-root",
            param="path",
        )
    if not resolved.is_dir():
        raise InvalidRequestError(f"adapter at {path}: no such directory on the server", param="path")
    for entry in resolved.iterdir():
        if not _resolve(entry).is_relative_to(root):
            raise PermissionDeniedError(
                f"adapter at {path}: {entry.name} links outside the adapter root {root}; copy the file in instead",
                param="path",
            )
    return resolved


def _resolve(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise InvalidRequestError(f"adapter path {path} cannot be resolved ({exc})", param="path") from None


class AdminRoutes:
    """Handlers bound to the server state (the state key is passed in to avoid an import cycle)."""

    def __init__(self, state_key: web.AppKey) -> None:
        self.key = state_key

    def _state(self, request: web.Request):
        state = request.app[self.key]
        state.access.require_admin(request)
        return state

    def _describe(self, state, adapter: str) -> AdapterOut:
        info = state.engine.adapter_info(adapter)
        return AdapterOut(
            id=info.name,
            owner=state.access.owners.get(info.name),
            parent=state.engine.base_name,
            path=str(info.path),
            rank=info.rank,
            target_modules=list(info.target_modules),
            size_bytes=info.size_bytes,
            num_params=info.num_params,
            tier=info.tier,
            in_flight=state.in_flight.get(info.name, 0),
        )

    async def register(self, request: web.Request) -> web.Response:
        state = self._state(request)
        body = await request.read()
        req = protocol.decode(body, protocol.AdapterCreateRequest)
        if not _ADAPTER_ID.match(req.id) or req.id in _RESERVED_IDS or req.id == state.engine.base_name:
            raise InvalidRequestError(
                f"adapter id {req.id!r} must be 1-128 letters, digits, '.', '_' or '-', start with a letter "
                "or digit, and not be 'none' or the base model's name",
                param="id",
            )
        if not state.access.is_tenant(req.tenant):
            raise InvalidRequestError(f"tenant {req.tenant!r} is not in the tenants file", param="tenant")
        if state.is_registered(req.id):
            raise ConflictError(f"adapter id {req.id!r} is already registered; DELETE it first", param="id")
        try:
            # Read and checked in a worker with a deadline: an adapter's files are untrusted input.
            path = await asyncio.get_running_loop().run_in_executor(None, _local_path, req.path, state.adapter_roots)
            await state.engine.register_adapter(req.id, path)
        except AdapterFormatError as exc:
            exc.param = exc.param or "path"
            raise
        state.access.owners[req.id] = req.tenant
        return _json(self._describe(state, req.id), status=201)

    async def list(self, request: web.Request) -> web.Response:
        state = self._state(request)
        return _json({"object": "list", "data": [self._describe(state, i.name) for i in state.engine.list_adapters()]})

    async def get(self, request: web.Request) -> web.Response:
        state = self._state(request)
        return _json(self._describe(state, request.match_info["id"]))

    async def delete(self, request: web.Request) -> web.Response:
        """Refuse (409) while requests run, or with ``?drain=true`` hide it and wait for them to end."""
        state = self._state(request)
        adapter = request.match_info["id"]
        state.engine.adapter_info(adapter)  # 404 when unknown
        drain = request.query.get("drain", "false").lower() in ("1", "true", "yes")
        timeout = _timeout(request.query.get("timeout", "60"))
        running = state.in_flight.get(adapter, 0)
        if running and not drain:
            raise AdapterBusyError(
                f"adapter {adapter!r} has {running} requests in flight; retry when they finish, or DELETE "
                "with ?drain=true to refuse new requests and remove it once they end",
                param="id",
            )
        if running:
            state.draining.add(adapter)
            try:
                if not await _wait_until(lambda: _removed_when_idle(state, adapter), timeout):
                    raise AdapterBusyError(
                        f"adapter {adapter!r} still had {state.in_flight.get(adapter, 0)} requests in flight "
                        f"after draining for {timeout:g}s; it was not deleted and serves again",
                        param="id",
                    )
            finally:
                state.draining.discard(adapter)
        else:
            state.engine.remove_adapter(adapter)  # 409 from the engine if it still holds requests
        state.access.owners.pop(adapter, None)
        return _json({"id": adapter, "object": "adapter", "deleted": True, "drained_requests": running})

    async def load(self, request: web.Request) -> web.Response:
        state = self._state(request)
        adapter = request.match_info["id"]
        await state.engine.load_adapter(adapter)
        return _json(self._describe(state, adapter))

    async def unload(self, request: web.Request) -> web.Response:
        state = self._state(request)
        adapter = request.match_info["id"]
        await state.engine.unload_adapter(adapter)
        return _json(self._describe(state, adapter))

    async def internal_state(self, request: web.Request) -> web.Response:
        state = self._state(request)
        server = {
            "requests_in_flight": len(state.request_ids),
            "in_flight_by_adapter": {k or "none": v for k, v in state.in_flight.items()},
            "draining_adapters": sorted(state.draining),
            "closing": state.closing,
        }
        return _json({"engine": state.engine.stats(), "server": server})


def _timeout(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise InvalidRequestError(f"timeout must be seconds between 0 and 3600; got {raw!r}", param="timeout")
    return value


def _removed_when_idle(state, adapter: str) -> bool:
    """Remove ``adapter`` once the server has no request for it and the engine has let go of it."""
    if state.in_flight.get(adapter, 0):
        return False
    try:
        state.engine.remove_adapter(adapter)
    except AdapterBusyError:
        return False
    return True


async def _wait_until(done, timeout: float) -> bool:
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
    app.router.add_post("/internal/adapters/{id}/load", routes.load)
    app.router.add_post("/internal/adapters/{id}/unload", routes.unload)
    app.router.add_get("/internal/state", routes.internal_state)

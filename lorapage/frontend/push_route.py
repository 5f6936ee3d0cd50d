"""``POST /v1/adapters/{id}/versions``: a trainer pushes a new version of an adapter from memory.

The body is the adapter's weights as one safetensors file (``Content-Type:
application/octet-stream``, PEFT key naming), its ``adapter_config.json`` object carried as a JSON
string in the safetensors header's ``__metadata__`` under ``adapter_config``
(:func:`lorapage.registry.push.encode` writes it; ``safetensors.torch.save(tensors,
metadata={"adapter_config": json.dumps(config)})`` anywhere else). One self-contained blob: its
digest is the version's, nothing else to keep in step. The query may add ``max_staleness`` (k:
kept for the id), ``tenant`` (the owner of a new id), ``expected_base_digest``, ``activate``
(``false``: stored and staged, not made current) and ``shm`` (a trainer on the same host: the
name of a file in ``/dev/shm`` holding those bytes, read instead of a body; a plain name, not a
link out of it).

The admin key only. The body is read as it streams and refused (413) past ``max_bytes``: a
declared length over it before anything is read. The version is checked as a directory
registration is, stored (201; 200 for content an existing version has), loaded into the pool and
made current before the answer, which describes it as ``GET /v1/adapters/{id}`` does.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from lorapage.adapters.files import read_regular
from lorapage.errors import BodyTooLargeError, InvalidRequestError
from lorapage.frontend.admin_ops import ADMIN
from lorapage.frontend.bodies import json_response, read_admin_body
from lorapage.frontend.state import STATE

# A rank-64 all-modules adapter of an 8B model in bfloat16 is about 340 MB.
PUSH_MAX_BODY_BYTES = 1 << 30
SHM_DIR = Path("/dev/shm")
_SHM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", re.ASCII)


class Pushed(Protocol):
    """A pushed version as the pusher answers it."""

    @property
    def key(self) -> str: ...  # id@N

    @property
    def version(self) -> int: ...


# (id, safetensors bytes, config None: in the metadata; keyword arguments: max_staleness, owner,
# expected_base_digest, activate, actor) -> the version.
Push = Callable[..., Awaitable[Pushed]]


class PushRoutes:
    """The push route over ``push`` (an engine's ``admin.push``), bodies of at most ``max_bytes``."""

    def __init__(self, push: Push, max_bytes: int) -> None:
        self._push, self.max_bytes = push, max_bytes

    async def push(self, request: web.Request) -> web.Response:
        state = request.app[STATE]
        actor = state.access.admin_actor(request)
        adapter_id = request.match_info["id"]
        query = request.query
        options: dict[str, Any] = {
            "max_staleness": _int(query.get("max_staleness"), "max_staleness"),
            "owner": query.get("tenant"),
            "expected_base_digest": query.get("expected_base_digest"),
            "activate": query.get("activate", "true").lower() not in ("0", "false", "no"),
        }
        body = await read_admin_body(request, self.max_bytes)
        if "shm" in query:
            if body:
                raise InvalidRequestError("send the bytes in the body or name them with shm, not both", param="shm")
            body = await asyncio.to_thread(read_shm, query["shm"], self.max_bytes)
        if not body:
            raise InvalidRequestError("the body must be the version's safetensors bytes", param="body")
        had = {row.version for row in request.app[ADMIN].store.index.versions(adapter_id)}
        pushed = await self._push(adapter_id, body, None, actor=actor, **options)
        if options["owner"] is not None:
            state.access.set_owner(adapter_id, options["owner"])
        described = (await request.app[ADMIN].deployment.describe([pushed.key]))[0]
        return json_response(described, status=200 if pushed.version in had else 201)


def read_shm(name: str, max_bytes: int, root: Path = SHM_DIR) -> bytes:
    """The bytes of the file ``name`` in ``root`` (``/dev/shm``): a plain name of a regular file
    there, at most ``max_bytes`` (413 past it); 400 for anything else (blocking: a worker)."""
    if not _SHM_NAME.fullmatch(name):
        raise InvalidRequestError("shm must be the plain name of a file in /dev/shm", param="shm")
    path = root / name
    if Path(os.path.realpath(path)).parent != root.resolve():
        raise InvalidRequestError(f"shm {name!r} links out of {root}", param="shm")
    try:
        if path.stat().st_size > max_bytes:
            raise BodyTooLargeError(f"shm {name!r} is over the limit of {max_bytes} bytes")
        return read_regular(path, max_bytes)
    except OSError as exc:
        raise InvalidRequestError(f"shm {name!r} could not be read: {exc.strerror or exc}", param="shm") from None


def _int(raw: str | None, param: str) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequestError(f"{param} must be an integer; got {raw!r}", param=param) from None


def add_push_routes(app: web.Application, push: Push, max_bytes: int = PUSH_MAX_BODY_BYTES) -> PushRoutes:
    """The push route over ``push`` (after the admin routes: the app's admin is read for its store)."""
    routes = PushRoutes(push, max_bytes)
    app.router.add_post("/v1/adapters/{id}/versions", routes.push)
    return routes

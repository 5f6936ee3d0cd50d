"""``GET /v1/audit`` and ``GET /v1/adapters/{id}/history``: the registry's audit trail and an id's
alias moves (issue 31; the rows are :mod:`lorapage.registry.audit`'s).

``/v1/audit`` takes the admin key only (a tenant key is 403). Query filters, each optional:
``adapter`` (an id), ``action`` (one of :data:`~lorapage.registry.audit.ACTIONS`), ``actor`` (a
key id: the first 12 hex of the key's sha256, or ``sighup``), ``since`` (Unix seconds or an ISO
time), ``before_id`` (rows older than that id: the next page), ``limit`` (1 to 1000, default 100);
newest first. A bad filter, or one lorapage does not know, is a 400 naming it.

``/v1/adapters/{id}/history`` takes the admin key or the key of the tenant owning the id (any
other tenant gets the 404 of an id that does not exist): the alias's and the named channels'
moves, newest first, each with the version before and after; the admin also sees who moved it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from lorapage.errors import AdapterNotFoundError, InvalidRequestError
from lorapage.frontend.admin_ops import ADMIN
from lorapage.frontend.auth import bearer_key
from lorapage.frontend.bodies import json_response
from lorapage.frontend.state import STATE
from lorapage.registry.audit import ACTIONS, DEFAULT_LIMIT, MAX_LIMIT, AliasMove, AuditEntry, AuditQuery
from lorapage.usage.report import parse_instant

AUDIT_FILTERS = ("adapter", "action", "actor", "since", "before_id", "limit")
_ACTOR = re.compile(r"[0-9a-f]{12}|sighup")
_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def audit_query(query: Mapping[str, str]) -> AuditQuery:
    """``GET /v1/audit``'s query string checked into an :class:`AuditQuery` (400 naming the bad filter)."""
    unknown = sorted(set(query) - set(AUDIT_FILTERS))
    if unknown:
        raise InvalidRequestError(
            f"unknown filter {unknown[0][:40]!r}; /v1/audit filters by {', '.join(AUDIT_FILTERS)}",
            param=unknown[0][:40],
        )
    adapter, action, actor = query.get("adapter"), query.get("action"), query.get("actor")
    if adapter is not None and not _ID.fullmatch(adapter):
        raise InvalidRequestError(
            f"adapter={adapter[:64]!r}: name an adapter id (1-128 letters, digits, '.', '_', '-'), not a version",
            param="adapter",
        )
    if action is not None and action not in ACTIONS:
        raise InvalidRequestError(f"action={action[:40]!r}: one of {', '.join(ACTIONS)}", param="action")
    if actor is not None and not _ACTOR.fullmatch(actor):
        raise InvalidRequestError(
            f"actor={actor[:40]!r}: a key id (the first 12 hex of sha256(key)) or 'sighup'", param="actor"
        )
    return AuditQuery(
        adapter=adapter,
        action=action,
        actor=actor,
        since=parse_instant(query["since"]) if "since" in query else None,
        before_seq=_bounded_int(query, "before_id", 1, 2**62, None),
        limit=_bounded_int(query, "limit", 1, MAX_LIMIT, DEFAULT_LIMIT),
    )


async def audit_list(
    query: Mapping[str, str], read: Callable[[AuditQuery], Awaitable[list[AuditEntry]]]
) -> dict[str, Any]:
    """``GET /v1/audit``'s answer (``lorapage serve``'s and the fleet's): ``query`` checked, the
    rows ``read`` returns for it, one more than the page asked to tell ``has_more``."""
    checked = audit_query(query)
    rows = await read(dataclasses.replace(checked, limit=checked.limit + 1))
    data = [entry_json(e) for e in rows[: checked.limit]]
    return {"object": "list", "data": data, "has_more": len(rows) > checked.limit}


def history_limit(query: Mapping[str, str]) -> int:
    """``limit`` of a history request (1 to 1000, default 100)."""
    return _bounded_int(query, "limit", 1, MAX_LIMIT, DEFAULT_LIMIT)


def _bounded_int(query: Mapping[str, str], name: str, low: int, high: int, default: Any) -> Any:
    raw = query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19 and low <= int(raw) <= high):
        raise InvalidRequestError(f"{name}={raw[:40]!r}: an integer from {low} to {high}", param=name)
    return int(raw)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def entry_json(entry: AuditEntry) -> dict[str, Any]:
    """One audit row as ``/v1/audit`` answers it."""
    return {
        "id": entry.seq,
        "object": "audit.entry",
        "time": _iso(entry.time),
        "created": entry.time,
        "actor": entry.actor,
        "tenant": entry.tenant,
        "action": entry.action,
        "adapter": entry.adapter,
        "before": None if entry.before is None else json.loads(entry.before),
        "after": None if entry.after is None else json.loads(entry.after),
        "outcome": entry.outcome,
    }


def history_body(
    adapter_id: str, moves: list[AliasMove], limit: int, current: int | None, channels: dict[str, int], *, admin: bool
) -> dict[str, Any]:
    """``GET /v1/adapters/{id}/history``'s answer (``lorapage serve``'s and the fleet's): the
    newest ``limit`` of ``moves`` (read with one more, to say whether there are more), where the
    alias and each channel point now; the actors to the admin only."""
    return {
        "object": "list",
        "adapter_id": adapter_id,
        "current": current,
        "channels": channels,
        "data": [move_json(m, with_actor=admin) for m in moves[:limit]],
        "has_more": len(moves) > limit,
    }


def move_json(move: AliasMove, *, with_actor: bool) -> dict[str, Any]:
    """One alias move as ``/v1/adapters/{id}/history`` answers it (the actor to the admin only)."""
    out: dict[str, Any] = {
        "id": move.seq,
        "object": "adapter.alias_move",
        "time": _iso(move.time),
        "created": move.time,
        "alias": f"{move.adapter_id}@{move.channel}" if move.channel else move.adapter_id,
        "channel": move.channel or None,
        "from_version": move.before,
        "to_version": move.after,
        "action": move.action,
    }
    if with_actor:
        out["actor"] = move.actor
    return out


class AuditRoutes:
    """``GET /v1/audit`` and ``GET /v1/adapters/{id}/history``: handlers over the front end's
    state (:data:`~lorapage.frontend.state.STATE`) and the app's admin."""

    async def audit(self, request: web.Request) -> web.Response:
        state = request.app[STATE]
        state.access.require_admin(request)
        return json_response(await audit_list(request.query, request.app[ADMIN].store.audit))

    async def history(self, request: web.Request) -> web.Response:
        state, ops = request.app[STATE], request.app[ADMIN]
        adapter_id = request.match_info["id"]
        key = bearer_key(request)
        admin = key is not None and state.access.tenants.is_admin(key)
        if not admin:
            tenant = state.access.tenant_for(request)  # 401 without a valid key
            state.release(state.admit(tenant))  # one of its requests per minute, as /v1/models takes
            if state.access.owners.get(adapter_id) != tenant:
                raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist", param="id")
        limit = history_limit(request.query)
        if adapter_id not in ops.store.index.ids():
            raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist; name the id, not a version", param="id")
        moves = await ops.store.history(adapter_id, limit + 1)
        current, channels = ops.store.index.serving(adapter_id), ops.store.index.channels(adapter_id)
        return json_response(history_body(adapter_id, moves, limit, current, channels, admin=admin))


def add_audit_routes(app: web.Application) -> None:
    """``GET /v1/audit`` and ``GET /v1/adapters/{id}/history`` over the app's admin operations
    (:data:`~lorapage.frontend.admin_ops.ADMIN`: the engine's registry, or the fleet's)."""
    routes = AuditRoutes()
    app.router.add_get("/v1/audit", routes.audit)
    app.router.add_get("/v1/adapters/{id}/history", routes.history)

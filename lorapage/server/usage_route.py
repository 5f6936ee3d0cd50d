"""``GET /v1/usage``: cost attribution by hour, tenant and adapter version (issue 31).

The admin key sees every row and may filter by ``tenant``; a tenant key sees its own requests'
rows and the residency and loads of the adapters it owns, nothing of anyone else's (``tenant=``
naming another tenant is 403). Query: ``since`` (Unix seconds or an ISO time: that hour and
later), ``adapter`` (an id, every version, or ``id@N``), ``format`` (``json``, default, or ``csv``).
The rows' fields are :mod:`lorapage.usage.ledger`'s.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from lorapage.errors import PermissionDeniedError
from lorapage.server.auth import bearer_key
from lorapage.usage.report import parse_format, parse_since, tenant_rows, usage_csv, usage_json


def _adapter_matches(version_key: str, wanted: str) -> bool:
    return version_key == wanted or version_key.rpartition("@")[0] == wanted


def add_usage_route(app: web.Application, state_key: web.AppKey) -> None:
    async def usage(request: web.Request) -> web.Response:
        state = request.app[state_key]
        key = bearer_key(request)
        caller = None if key is not None and state.access.tenants.is_admin(key) else state.access.tenant_for(request)
        query = request.query
        fmt = parse_format(query.get("format"))
        since = parse_since(query["since"]) if "since" in query else None
        rows = state.engine.usage_rows(since_hour=since)
        if caller is not None:
            if query.get("tenant", caller) != caller:
                raise PermissionDeniedError("a tenant key sees its own usage only; drop tenant=", param="tenant")
            rows = tenant_rows(rows, caller, state.access.owners)
        elif "tenant" in query:
            rows = [(k, u) for k, u in rows if k[1] == query["tenant"]]
        if "adapter" in query:
            rows = [(k, u) for k, u in rows if _adapter_matches(k[2], query["adapter"])]
        if fmt == "csv":
            return web.Response(text=usage_csv(rows), content_type="text/csv")
        return web.Response(body=msgspec.json.encode(usage_json(rows)), content_type="application/json")

    app.router.add_get("/v1/usage", usage)

"""``GET /v1/usage``: cost attribution by hour, tenant and adapter version (issue 31).

The admin key sees every row and may filter by ``tenant``; a tenant key sees its own requests'
rows and the residency and loads of the adapters it owns, nothing of anyone else's (``tenant=``
naming another tenant is 403). Query: ``since`` (Unix seconds or an ISO time: that hour and
later), ``adapter`` (an id, every version, or ``id@N``), ``format`` (``json``, default, or ``csv``).
The rows' fields are :mod:`lorapage.usage.ledger`'s. A tenant's call takes one of its requests
per minute; the rows are filtered and encoded in a worker, off the event loop. :func:`usage_request` and
:func:`usage_answer` are the route's rule; the route itself is the front end's
(:func:`lorapage.frontend.app.usage`), over the backend's rows (the engines' ledgers here, every
replica's summed in a fleet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
from aiohttp import web

from lorapage.errors import PermissionDeniedError
from lorapage.frontend.caller import Admits, admin_or_tenant
from lorapage.usage.ledger import Key, Usage
from lorapage.usage.report import parse_format, parse_since, tenant_rows, usage_csv, usage_json


@dataclass(frozen=True)
class UsageRequest:
    """A checked ``GET /v1/usage``: who asks (None: the admin) and what."""

    caller: str | None
    fmt: str
    since_hour: int | None
    query: Mapping[str, str]


def usage_request(state: Admits, request: web.Request, query: Mapping[str, str]) -> UsageRequest:
    """The caller (401 without a known key; a tenant's request taken, 429 without) and the query
    checked (400 naming a bad field, 403 for a tenant key naming another tenant), before any row
    is read."""
    caller = admin_or_tenant(state, request)
    fmt = parse_format(query.get("format"))
    since = parse_since(query["since"]) if "since" in query else None
    if caller is not None and query.get("tenant", caller) != caller:
        raise PermissionDeniedError("a tenant key sees its own usage only; drop tenant=", param="tenant")
    return UsageRequest(caller, fmt, since, query)


def _adapter_matches(version_key: str, wanted: str) -> bool:
    return version_key == wanted or version_key.rpartition("@")[0] == wanted


def usage_answer(req: UsageRequest, rows: Sequence[tuple[Key, Usage]], owners: Mapping[str, str]) -> tuple[bytes, str]:
    """The body and content type of the answer: ``rows`` (``since`` applied) filtered for the caller."""
    query = req.query
    if req.caller is not None:
        rows = tenant_rows(rows, req.caller, owners)
    elif "tenant" in query:
        rows = [(k, u) for k, u in rows if k[1] == query["tenant"]]
    if "adapter" in query:
        rows = [(k, u) for k, u in rows if _adapter_matches(k[2], query["adapter"])]
    if req.fmt == "csv":
        return usage_csv(rows).encode(), "text/csv"
    return msgspec.json.encode(usage_json(rows)), "application/json"

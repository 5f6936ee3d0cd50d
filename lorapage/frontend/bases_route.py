"""Base upgrades over HTTP: validating every adapter on a candidate base, migrating those that passed.

Both front ends serve these routes, over a :class:`BaseUpgrades`: ``lorapage serve``'s engines
(:class:`LocalUpgrades`), or a fleet's deployments (:mod:`lorapage.fleet.upgrades`). (An adapter's
check prompts, ``PUT`` / ``GET /v1/adapters/{id}/check_prompts``, are an admin route:
:mod:`lorapage.frontend.admin`.)

- ``POST /v1/bases/{digest}/validate`` (admin), body ``{"model": DIR, "adapters": [ids]?}``: starts
  a validation job toward base ``digest`` (``sha256:HEX`` or bare hex), whose directory ``DIR``
  (absolute; any the server process can read: the admin key is the operator's) must hold that
  digest. 202 with the job; 409 while another runs (one at a time). Toward a base this server
  runs beside its own (``--base``, :mod:`lorapage.serve.engines`), ``model`` may be left out: that
  engine is checked on, none is loaded. See :mod:`lorapage.bases.validation`.
- ``GET /v1/bases/{digest}/validate`` (admin, or a tenant key for its own adapters): the latest
  job's progress, each adapter version's migration state toward ``digest`` with its numbers and
  customer notice, and a per-tenant report (``?tenant=`` narrows it; a tenant key sees its own
  only, and naming another tenant is 403).
- ``POST /v1/bases/{digest}/migrate`` (admin), body ``{"adapters": [ids]?}``: each adapter whose
  current version ``passed`` gets a new version bound to ``digest`` (same files; the alias stays
  where it is, and an engine on the new base serves the id through it: at once, when this server
  runs that base beside its own): audited as ``migrate``.
  Named adapters that did not pass are refused (409 naming the state) and nothing moves; without
  names, those are listed as skipped with their state.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

from aiohttp import web

from lorapage.adapters.binding import shown_digest
from lorapage.adapters.digest import digest_param
from lorapage.bases.validation import BaseValidator, ValidationJob, parse_key
from lorapage.errors import ConflictError, PermissionDeniedError
from lorapage.frontend import protocol
from lorapage.frontend.bodies import json_response, read_admin_body
from lorapage.frontend.caller import admin_or_tenant
from lorapage.frontend.state import STATE
from lorapage.registry.drift_state import (
    FAILED,
    MIGRATED,
    OPTED_OUT,
    PASSED,
    PENDING,
    DriftRecord,
    MigrationRow,
)
from lorapage.registry.store import VersionRow

VALIDATOR = web.AppKey("lorapage_base_validator", BaseValidator)


def _target(request: web.Request) -> str:
    return digest_param(request.match_info["digest"], "digest")


def _row_out(row: MigrationRow, owner: str | None) -> dict[str, Any]:
    return {
        "id": row.adapter_id,
        "version": row.version,
        "tenant": owner,
        "state": row.state,
        "reason": row.reason,
        "numbers": row.numbers,
        "notice": row.notice,
        "new_version": row.new_version,
        "updated": row.updated,
    }


def tenant_report(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tenant (``null`` key: shared adapters): counts by state and each adapter's notice."""
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {s: 0 for s in (PENDING, PASSED, FAILED, MIGRATED, OPTED_OUT)})
    for row in rows:
        entry = out[row["tenant"] or ""]
        entry[row["state"]] += 1
        entry.setdefault("notices", []).append(row["notice"] or f"{row['id']}: {row['state']} ({row['reason']})")
    return dict(out)


class BaseUpgrades(Protocol):
    """What the base-upgrade routes act on: ``lorapage serve``'s engines (:class:`LocalUpgrades`),
    or a fleet's deployments and registry (:class:`lorapage.fleet.upgrades.FleetUpgrades`)."""

    digest: str  # the running (primary) base's
    drift_record: DriftRecord  # the record of check prompts and migration states (blocking)

    def current_versions(self, adapters: Sequence[str] | None) -> list[str]:
        """The versions to check or migrate: each id's current one on the running base."""
        ...

    async def validate(
        self, validator: BaseValidator, target: str, model: str | None, adapters: Sequence[str] | None
    ) -> ValidationJob:
        """Start ``validator``'s job toward ``target`` (``model``: the candidate's directory, where one is needed)."""
        ...

    async def migrate(self, row: MigrationRow, actor: str) -> VersionRow:
        """A passed version stored again bound to its target base, and served from now on."""
        ...


UPGRADES = web.AppKey("lorapage_base_upgrades", BaseUpgrades)


class BaseRoutes:
    """The base-upgrade routes: handlers over the front end's state and a
    :class:`BaseUpgrades`."""

    def __init__(self, upgrades: BaseUpgrades) -> None:
        self.upgrades = upgrades

    async def validate(self, request: web.Request) -> web.Response:
        state = request.app[STATE]
        state.access.require_admin(request)
        target = _target(request)
        req = protocol.decode(await read_admin_body(request), protocol.ValidateRequest)
        job = await self.upgrades.validate(request.app[VALIDATOR], target, req.model, req.adapters)
        body = {"object": "base.validation", "job": job.id, "status": job.status, "target": shown_digest(target)}
        return json_response({**body, "adapters": job.adapters}, status=202)

    async def progress(self, request: web.Request) -> web.Response:
        state = request.app[STATE]
        caller = admin_or_tenant(state, request)
        target = _target(request)
        wanted = request.query.get("tenant")
        if caller is not None and wanted not in (None, caller):
            raise PermissionDeniedError("a tenant key sees its own adapters only; drop tenant=", param="tenant")
        wanted = caller if caller is not None else wanted
        owners = state.access.owners
        rows = [
            _row_out(r, owners.get(r.adapter_id))
            for r in await asyncio.to_thread(self.upgrades.drift_record.migration_states, target)
        ]
        if wanted is not None:
            rows = [r for r in rows if r["tenant"] == wanted]
        job = request.app[VALIDATOR].latest(target)
        shown = None
        if job is not None:
            shown = {"id": job.id, "status": job.status, "error": job.error, "started": job.started}
            shown |= {"finished": job.finished, "adapters": len(job.adapters), "checked": job.checked}
            if caller is not None:  # the job's counts are every tenant's: a tenant's own adapters only
                shown |= {"adapters": sum(owners.get(k.partition("@")[0]) == caller for k in job.adapters)}
                del shown["checked"]  # its rows' states say how far its own checks are
            if caller is None:
                shown["model"] = job.model
        body = {
            "object": "base.validation",
            "target": shown_digest(target),
            "running_base": shown_digest(self.upgrades.digest),
            "job": shown,
            "adapters": rows,
            "tenants": tenant_report(rows),
        }
        return json_response(body)

    async def migrate(self, request: web.Request) -> web.Response:
        state = request.app[STATE]
        actor = state.access.admin_actor(request)
        target = _target(request)
        body = await read_admin_body(request)
        req = protocol.decode(body, protocol.MigrateRequest) if body.strip() else protocol.MigrateRequest()
        job = request.app[VALIDATOR].latest(target)
        if job is not None and job.status == "running":
            raise ConflictError(f"validation {job.id} toward {shown_digest(target)} is still running; migrate after it")
        keys = self.upgrades.current_versions(req.adapters)
        states = {r.key: r for r in await asyncio.to_thread(self.upgrades.drift_record.migration_states, target)}
        ready, skipped = [], []
        for key in keys:
            row = states.get(key)
            if row is not None and row.state in (PASSED, MIGRATED):
                ready.append(row)
                continue
            why = f"{row.state}" + (f": {row.reason}" if row.reason else "") if row else "never checked"
            if req.adapters is not None:
                raise ConflictError(
                    f"adapter {key} cannot migrate to {shown_digest(target)}: its drift check is {why}; only an "
                    "adapter whose check passed moves (POST /v1/bases/{digest}/validate)",
                    param="adapters",
                )
            skipped.append({"id": parse_key(key)[0], "version": parse_key(key)[1], "state": why})
        migrated = []
        for row in ready:
            new = await self.upgrades.migrate(row, actor)
            migrated.append({"id": row.adapter_id, "from_version": row.version, "version": new.version})
        return json_response(
            {"object": "base.migration", "target": shown_digest(target), "migrated": migrated, "skipped": skipped}
        )


def add_base_routes(app: web.Application, upgrades: BaseUpgrades) -> None:
    """The base-upgrade routes over ``upgrades`` (``lorapage serve``'s engines, or a fleet's deployments)."""
    routes = BaseRoutes(upgrades)
    app[VALIDATOR] = BaseValidator()
    app[UPGRADES] = upgrades

    async def stop_validation(app: web.Application) -> None:
        await app[VALIDATOR].cancel()

    app.on_shutdown.append(stop_validation)

    app.router.add_post("/v1/bases/{digest}/validate", routes.validate)
    app.router.add_get("/v1/bases/{digest}/validate", routes.progress)
    app.router.add_post("/v1/bases/{digest}/migrate", routes.migrate)

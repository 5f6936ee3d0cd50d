"""The fleet ingress's operations parts, without Ray: its registry's audit trail (a real SQLite
file) read through ``lorapage serve``'s ``/v1/audit`` answer, the replicas' usage rows summed, and
replica targets. (What the ingress records of each answer, SLOs and the request log, is the one
front end's middleware: tests/server.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from lorapage.errors import InvalidRequestError
from lorapage.fleet.registry import FleetRegistry
from lorapage.fleet.routing import replica_target, targeted_replica
from lorapage.frontend.audit_route import audit_list
from lorapage.registry.audit import AuditQuery
from lorapage.registry.catalog import PreparedVersion
from lorapage.registry.prepare import PreparedVersion
from lorapage.registry.store import REGISTRY_FILE, Registry
from lorapage.tenancy.tenants import key_id
from lorapage.usage.ledger import Usage
from lorapage.usage.report import summed, usage_json

ADMIN = key_id("an-admin-key")
BASE_DIGEST = "b" * 64


def version(n: int) -> PreparedVersion:
    return PreparedVersion(f"file:///adapters/v{n}", f"{n:064x}", BASE_DIGEST, "{}", 8, ("q_proj",), 1024, 1.5)


def test_every_fleet_registry_write_is_audited_as_its_actor(tmp_path: Path) -> None:
    fleet = FleetRegistry(Registry(tmp_path / REGISTRY_FILE))
    fleet.add("acme", "alpha", version(1), activate=True, actor=ADMIN)
    fleet.add("acme", "alpha", version(2), activate=False, actor=ADMIN)
    fleet.set_current("acme", 2, actor=ADMIN)
    asyncio.run(fleet.set_pinned("acme@2", True, actor=ADMIN))
    undone = "pin undone: its load failed (adapter_load_failed)"
    asyncio.run(fleet.set_pinned("acme@2", False, actor=ADMIN, outcome=undone))
    asyncio.run(fleet.record("load", "acme", actor=ADMIN, after={"version": 2}))
    fleet.drop("acme@2", actor=ADMIN)
    fleet.remove("acme@1", actor=ADMIN)
    fleet.note("tenants_reload", None, actor="sighup", after={"tenants": ["alpha"]})

    rows = asyncio.run(fleet.audit(AuditQuery()))
    assert [r.action for r in rows] == [
        "tenants_reload", "delete", "unload", "load", "unpin", "pin", "deploy", "register", "register",
    ]  # fmt: skip
    assert {r.actor for r in rows[1:]} == {ADMIN} and rows[0].actor == "sighup"
    assert {r.tenant for r in rows[1:]} == {"alpha"} and rows[0].tenant is None
    assert rows[4].outcome.startswith("pin undone") and rows[5].outcome == "ok"
    assert json.loads(rows[2].after or "") == {"version": 2}

    # Read back through lorapage serve's /v1/audit answer: its filters and paging.
    read = fleet.audit
    page = asyncio.run(audit_list({"actor": ADMIN, "limit": "3"}, read))
    assert page["has_more"] is True and [e["action"] for e in page["data"]] == ["delete", "unload", "load"]
    assert page["data"][0]["object"] == "audit.entry" and page["data"][0]["actor"] == ADMIN
    rest = asyncio.run(audit_list({"actor": ADMIN, "before_id": str(page["data"][-1]["id"])}, read))
    assert rest["has_more"] is False and [e["action"] for e in rest["data"]][:2] == ["unpin", "pin"]
    deploys = asyncio.run(audit_list({"adapter": "acme", "action": "deploy"}, read))
    assert [e["after"] for e in deploys["data"]] == [{"current": 2}]
    with pytest.raises(InvalidRequestError, match="unknown filter 'who'"):
        asyncio.run(audit_list({"who": "me"}, read))


def test_replicas_usage_rows_sum_into_one_ledgers() -> None:
    first = [((10, "alpha", "acme@1"), Usage(requests=2, output_tokens=40, device_s=0.5))]
    second = [
        ((9, "", "acme@1"), Usage(adapter_page_s=30.0, load_bytes=1024)),
        ((10, "alpha", "acme@1"), Usage(requests=1, output_tokens=8, device_s=0.25)),
        ((10, "beta", ""), Usage(requests=1, prompt_tokens=5)),
    ]
    rows = summed([first, second, []])
    assert [key for key, _ in rows] == [(9, "", "acme@1"), (10, "alpha", "acme@1"), (10, "beta", "")]
    assert rows[1][1] == Usage(requests=3, output_tokens=48, device_s=0.75)
    parts = [usage_json(first)["total"], usage_json(second)["total"]]
    assert usage_json(rows)["total"] == {k: parts[0][k] + parts[1][k] for k in parts[0]}  # still adds up
    assert first[0][1] == Usage(requests=2, output_tokens=40, device_s=0.5)  # the parts are not changed


def test_a_replica_target_is_never_an_adapter_id() -> None:
    assert targeted_replica(replica_target("ab12cd")) == "ab12cd"
    assert targeted_replica("acme") is None and targeted_replica("") is None

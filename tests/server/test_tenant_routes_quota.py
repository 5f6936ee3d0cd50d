"""Every route a tenant key reaches takes the tenant's request quota (issue 38, findings 4 and 6),
over a real server: the routes are read off the app's router, so a route added later is held to
the rule too. A tenant with ``rpm = 1`` is answered once a minute whatever it calls (its second
call is a 429), the admin key takes no quota, and an owner's PUT that changes nothing adds no
audit row."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from server_harness import ADMIN_KEY, Server, assert_openai_error, make_engine, make_roots, running_server

from lorapage.frontend import Access, hash_key
from lorapage.tenancy.tenants import TenantsConfig
from lorapage.tiny import demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")

NO_KEY = {"/health", "/ping", "/version", "/metrics"}  # answered alike to anyone (or to scrape keys)
FILL = {"id": "owned", "model": "owned", "channel": "prod", "digest": "0" * 64}
TENANTS = 40  # one fresh tenant (rpm 1) per route
OWNER_KEY = "k-owner"


def _tenants_toml() -> str:
    parts = [f'[admin]\nkey_sha256 = ["{hash_key(ADMIN_KEY)}"]\n']
    parts.append(f'[tenants.owner]\nkey_sha256 = ["{hash_key(OWNER_KEY)}"]\nadapters = ["*"]\nrpm = 1\n')
    for i in range(TENANTS):
        parts.append(f'[tenants.r{i}]\nkey_sha256 = ["{hash_key(f"k-r{i}")}"]\nadapters = ["*"]\nrpm = 1\n')
    return "\n".join(parts)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv() -> AsyncIterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="lorapage-quota-routes-")).resolve()
    shutil.copytree(demo_adapter_dirs()["acme"], root / "owned")
    engine = make_engine(make_roots(root))
    try:
        async with running_server(engine, Access(TenantsConfig.from_toml(_tenants_toml()))) as server:
            body = {"id": "owned", "source": str(root / "owned"), "tenant": "owner"}
            status, payload, _ = await server.post("/v1/adapters", body, tenant=None, headers=server.admin())
            assert status == 201, payload
            yield server
    finally:
        await engine.close()


def _routes(srv: Server) -> list[tuple[str, str]]:
    found = set()
    for route in srv.app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        pattern = info.get("path") or info.get("formatter")
        if route.method in ("HEAD", "*") or pattern is None:
            continue
        found.add((route.method, re.sub(r"\{(\w+)\}", lambda m: FILL[m.group(1)], pattern)))
    return sorted(found)


async def _call(srv: Server, method: str, path: str, key: str) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with srv.session.request(method, srv.url + path, headers=headers, data=b"{}") as resp:
        return resp.status, await resp.json(content_type=None) if await resp.read() else None


async def test_every_route_a_tenant_key_reaches_takes_its_request_quota(srv: Server) -> None:
    routes = _routes(srv)
    assert len(routes) <= TENANTS and ("GET", "/v1/usage") in routes
    unmetered = []
    for n, (method, path) in enumerate(routes):
        key = f"k-r{n}"
        first, _ = await _call(srv, method, path, key)
        second, body = await _call(srv, method, path, key)
        if path in NO_KEY:
            continue
        if first in (401, 403):  # the admin's (or a scrape key's) route: refused alike, nothing done
            assert second == first, (method, path, second, body)
            continue
        if second != 429:
            unmetered.append((method, path, first, second))
            continue
        assert_openai_error(body, 429)
    assert not unmetered, unmetered


async def test_the_admin_key_takes_no_tenant_quota(srv: Server) -> None:
    for _ in range(3):
        status, body = await _call(srv, "GET", "/v1/usage", ADMIN_KEY)
        assert status == 200, body


async def test_owner_writes_take_quota_and_a_no_op_adds_no_audit_row(srv: Server) -> None:
    """The owner (rpm 1) floods PUTs of its check prompts: one is answered, the rest 429 and
    nothing else; an unchanged PUT (here the admin's, which takes no quota) writes no row."""
    headers = {"Authorization": f"Bearer {OWNER_KEY}"}
    answers = [
        (await srv.request("PUT", "/v1/adapters/owned/check_prompts", headers=headers, body={"prompts": ["hi"]}))[0]
        for _ in range(20)
    ]
    assert answers[0] == 200 and answers[1:] == [429] * 19, answers
    for _ in range(5):
        status, body, _ = await srv.request(
            "PUT", "/v1/adapters/owned/check_prompts", headers=srv.admin(), body={"prompts": ["hi"]}
        )
        assert status == 200 and body["prompts"] == ["hi"], body
    status, audit, _ = await srv.request("GET", "/v1/audit?action=check_prompts", headers=srv.admin())
    assert status == 200 and len(audit["data"]) == 1, audit


async def test_usage_rows_are_filtered_and_encoded_off_the_event_loop(srv: Server, monkeypatch) -> None:
    """The ledger's rows may number a hundred thousand: a call's filtering and encoding run in a
    worker thread, not on the loop that serves every tenant."""
    import threading

    from lorapage.frontend import app as app_module

    threads: list[str] = []
    answer = app_module.usage_answer

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return answer(*args)

    monkeypatch.setattr(app_module, "usage_answer", recorded)
    status, body = await _call(srv, "GET", "/v1/usage", ADMIN_KEY)
    assert status == 200, body
    assert threads and threads[0] != threading.main_thread().name, threads

"""``GET /v1/adapters/{id}`` over real HTTP: its traffic tier, status, projected cost and last 24
hours of traffic; the admin sees any adapter, a tenant only those registered for it (without
where the operator keeps the files), and any other adapter is the same 404 as one that does not
exist."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from server_harness import assert_openai_error, server  # noqa: F401 (the module's fixture)

from lorapage.tiny import demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _register_for(server, adapter_id: str, tenant: str, demo: str) -> None:
    root = Path(tempfile.mkdtemp(dir=server.adapter_root))
    shutil.copytree(demo_adapter_dirs()[demo], root / "a")
    body = {"id": adapter_id, "path": (root / "a").as_uri(), "tenant": tenant}
    status, info, _ = await server.post("/v1/adapters", body, tenant=None, headers=server.admin())
    assert status == 201, info


def _hour_now() -> str:
    return time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime())


async def _get(server, name: str, headers):
    return await server.request("GET", f"/v1/adapters/{name}", headers=headers)


async def test_the_owner_sees_its_adapter_with_tier_and_traffic(server):
    await _register_for(server, "beta-tiers", "beta", "globex")
    first = _hour_now()
    for _ in range(3):
        body = {"model": "beta-tiers", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        status, out, _ = await server.post("/v1/completions", body, tenant="beta")
        assert status == 200, out

    status, got, _ = await _get(server, "beta-tiers", server.auth("beta"))
    assert status == 200, got
    assert got["id"] == "beta-tiers" and got["owner"] == "beta" and got["version"] == 1
    assert got["traffic_tier"] == "cold"  # judged every tier_interval_s; not yet
    assert got["status"] in ("resident", "available") and got["kept_hot"] is False
    assert got["projected_cost_pct"] > 0 and got["serving_tier"] == "shared"
    assert got["path"] == "" and got["source"] == ""  # the operator's
    traffic = got["traffic"]
    assert {h["hour"] for h in traffic["hours"]} <= {first, _hour_now()}  # calendar hours (one, unless one ended)
    assert traffic["last_24h"]["requests"] == sum(h["requests"] for h in traffic["hours"]) == 3
    assert traffic["last_24h"]["output_tokens"] == 12 and traffic["last_24h"]["prompt_tokens"] > 0

    # Judged now (as the engine does every tier_interval_s): 3 requests in the hour is warm.
    assert (await server.engine.admin.refresh_tiers())["beta-tiers@1"] == "warm"
    status, got, _ = await _get(server, "beta-tiers@1", server.auth("beta"))
    assert status == 200 and got["traffic_tier"] == "warm" and got["traffic"]["last_24h"]["requests"] == 3


async def test_another_tenant_gets_the_404_of_an_adapter_that_does_not_exist(server):
    await _register_for(server, "beta-private", "beta", "initech")
    missing = await _get(server, "no-such-adapter", server.auth("alpha"))
    assert missing[0] == 404
    for name in ("beta-private", "beta-private@1", "acme"):  # beta's, and a shared one alpha may use
        status, body, _ = await _get(server, name, server.auth("alpha"))
        assert_openai_error(body, 404)
        assert body["error"]["message"] == missing[1]["error"]["message"].replace("no-such-adapter", name)
    status, body, _ = await _get(server, "beta-private", {})
    assert status == 401, body
    status, body, _ = await _get(server, "beta-private", {"Authorization": "Bearer wrong"})
    assert status == 401, body


async def test_the_admin_sees_every_adapter_with_its_files(server):
    await _register_for(server, "beta-admin", "beta", "acme")
    for name, owner in (("beta-admin", "beta"), ("acme", None)):
        status, got, _ = await _get(server, name, server.admin())
        assert status == 200, got
        assert got["owner"] == owner and got["path"] and got["source"].startswith("file:")
        assert got["traffic"]["last_24h"]["hour"].endswith(":00:00Z") and got["traffic_tier"] in ("cold", "warm")
    status, body, _ = await _get(server, "no-such-adapter", server.admin())
    assert_openai_error(body, 404)

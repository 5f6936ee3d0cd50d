"""``GET /v1/usage`` over real HTTP: the admin sees every tenant's rows and they add up to the
engine's totals; a tenant sees its own requests and its own adapters' residency and loads, never
another's; JSON and CSV carry the same rows; bad queries are OpenAI errors."""

from __future__ import annotations

import csv
import io
import math
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from server_harness import assert_openai_error, server  # noqa: F401 (the module's fixture)

from lorapage.tiny import demo_adapter_dirs
from lorapage.usage import USAGE_FIELDS

pytestmark = pytest.mark.asyncio(loop_scope="module")
COMP = "/v1/completions"


async def _complete(server, model: str, tenant: str) -> None:
    body = {"model": model, "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
    status, out, _ = await server.post(COMP, body, tenant=tenant)
    assert status == 200, out


async def _usage(server, query: str = "", headers=None):
    return await server.request("GET", f"/v1/usage{query}", headers=headers or server.admin())


async def test_every_tenants_usage_by_hour_adds_up_to_the_engine_totals(server):
    root = Path(tempfile.mkdtemp(dir=server.adapter_root))
    shutil.copytree(demo_adapter_dirs()["globex"], root / "g")
    status, info, _ = await server.post(
        "/v1/adapters", {"id": "beta-own", "path": (root / "g").as_uri(), "tenant": "beta"}, tenant=None,
        headers=server.admin(),
    )  # fmt: skip
    assert status == 201, info
    for _ in range(2):
        await _complete(server, "acme", "alpha")
        await _complete(server, "beta-own", "beta")
        await _complete(server, server.engine.base_name, "gamma")

    status, body, _ = await _usage(server)
    assert status == 200, body
    rows = body["data"]
    assert {r["tenant"] for r in rows} >= {"alpha", "beta", "gamma", ""}
    hour = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime())
    assert hour in {r["hour"] for r in rows}  # calendar hours, not the engine's monotonic clock
    totals = server.engine.debug.usage.totals
    for name in USAGE_FIELDS:  # every row of every tenant: the engine's totals
        assert math.isclose(sum(r[name] for r in rows), getattr(totals, name), rel_tol=0.01), name
        assert math.isclose(body["total"][name], getattr(totals, name), rel_tol=1e-9), name
    own = [r for r in rows if r["tenant"] == "" and r["adapter"].startswith("beta-own@")]
    assert own and sum(r["load_bytes"] for r in own) > 0

    status, text, headers = await _usage(server, "?format=csv")
    assert status == 200 and headers["Content-Type"].startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(text)))
    keys = [(r["hour"], r["tenant"], r["adapter"]) for r in rows]
    assert [(r["hour"], r["tenant"], r["adapter"]) for r in parsed] == keys
    assert [float(r["device_s"]) for r in parsed] == pytest.approx([r["device_s"] for r in rows])

    status, body, _ = await _usage(server, "?tenant=alpha")
    assert status == 200 and {r["tenant"] for r in body["data"]} == {"alpha"}
    status, body, _ = await _usage(server, "?adapter=beta-own")
    assert status == 200 and body["data"] and {r["adapter"].rpartition("@")[0] for r in body["data"]} == {"beta-own"}


async def test_a_tenant_sees_its_own_requests_and_adapters_only(server):
    await _complete(server, "acme", "alpha")
    await _complete(server, "initech", "beta")
    status, body, _ = await _usage(server, headers=server.auth("beta"))
    assert status == 200, body
    rows = body["data"]
    mine = [r["tenant"] == "beta" or (r["tenant"] == "" and r["adapter"].startswith("beta-own@")) for r in rows]
    assert rows and all(mine)
    # A shared adapter: its requests' rows, not its residency.
    assert any(r["tenant"] == "beta" and r["adapter"].startswith("initech@") for r in rows)
    assert not any(r["adapter"].startswith(("acme@", "initech@")) and r["tenant"] == "" for r in rows)
    status, body, _ = await _usage(server, "?tenant=alpha", headers=server.auth("beta"))
    assert status == 403
    assert_openai_error(body, 403, "tenant")


async def test_bad_queries_and_keys_are_openai_errors(server):
    status, body, _ = await _usage(server, "?format=xml")
    assert status == 400
    assert_openai_error(body, 400, "format")
    status, body, _ = await _usage(server, "?since=yesterday")
    assert status == 400
    assert_openai_error(body, 400, "since")
    status, body, _ = await _usage(server, headers={"Authorization": "Bearer nope"})
    assert status == 401
    assert_openai_error(body, 401)
    later = time.time() + 7200
    status, body, _ = await _usage(server, f"?since={later}")
    assert status == 200 and body["data"] == []
    status, body, _ = await _usage(server, "?since=2020-01-01T00:00:00Z")
    assert status == 200 and body["data"]

"""Tenant isolation, the admin key, and the admin routes (register, inspect, delete, load, state)."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from server_harness import BASE, assert_openai_error, running_server, server  # noqa: F401 (the module's fixture)

from lorapage.frontend.app import STATE
from lorapage.tiny import DEMO_MARKERS, demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")

COMP, CHAT = "/v1/completions", "/v1/chat/completions"


def _body(model: str, **extra) -> dict:
    return {"model": model, "prompt": "hi", "max_tokens": 2, **extra}


async def test_other_tenants_adapter_is_indistinguishable_from_a_missing_one(server):
    assert (await server.post(COMP, _body("initech"), tenant="beta"))[0] == 200
    assert (await server.post(COMP, _body(f"{BASE}:initech"), tenant="beta"))[0] == 200
    status_other, other, _ = await server.post(COMP, _body("initech"), tenant="alpha")
    status_none, missing, _ = await server.post(COMP, _body("nonexistent"), tenant="alpha")
    assert status_other == status_none == 404
    assert other["error"]["message"].replace("initech", "X") == missing["error"]["message"].replace("nonexistent", "X")
    assert {k: v for k, v in other["error"].items() if k != "message"} == {
        k: v for k, v in missing["error"].items() if k != "message"
    }
    # Both tenants may use the base model; each lists only its own adapters.
    assert (await server.post(COMP, _body(BASE), tenant="beta"))[0] == 200
    _, models, _ = await server.request("GET", "/v1/models", headers=server.auth("beta"))
    assert {m["id"] for m in models["data"]} == {BASE, "initech"}


async def test_keys(server):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-alpha"}):
        status, body, _ = await server.request("POST", COMP, headers=headers, body=_body("acme"))
        assert status == 401
        assert_openai_error(body, 401)


async def test_admin_routes_refuse_tenant_keys(server):
    routes = [
        ("GET", "/internal/state"),
        ("DELETE", "/v1/adapters/acme"),
        ("POST", "/internal/adapters/acme/load"),
        ("POST", "/internal/adapters/acme/unload"),
        ("POST", "/v1/adapters"),
        ("GET", "/v1/adapters"),
    ]
    for method, path in routes:
        assert (await server.request(method, path, headers=server.auth("alpha")))[0] == 403, path
        assert (await server.request(method, path))[0] == 401, path
    assert (await server.request("GET", "/v1/adapters/acme", headers=server.admin()))[0] == 200
    # One adapter is readable by its owner (tests/server/test_adapter_get_route.py): acme has none, so a
    # tenant that may use it still gets the 404 of an unknown adapter.
    assert (await server.request("GET", "/v1/adapters/acme", headers=server.auth("alpha")))[0] == 404
    assert (await server.request("GET", "/v1/adapters/acme"))[0] == 401


@pytest.fixture
def in_root(server) -> Path:
    """A fresh directory under the server's adapter root (registration reads only there)."""
    return Path(tempfile.mkdtemp(dir=server.adapter_root))


def _copy_demo(tmp_path, name: str = "acme"):
    dst = tmp_path / f"copy-of-{name}"
    shutil.copytree(demo_adapter_dirs()[name], dst)
    return dst


async def test_registration_refuses_bad_adapters_and_keeps_serving(server, in_root):
    not_json = _copy_demo(in_root)
    (not_json / "adapter_config.json").write_text("{ not json")
    mismatched = in_root / "mismatched"
    shutil.copytree(demo_adapter_dirs()["acme"], mismatched)
    weights = load_file(mismatched / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    weights[key] = torch.zeros(weights[key].shape[0], weights[key].shape[1] + 3)
    save_file(weights, mismatched / "adapter_model.safetensors")
    no_weights = in_root / "no-weights"
    no_weights.mkdir()
    shutil.copy(demo_adapter_dirs()["acme"] / "adapter_config.json", no_weights)
    cases = [
        ({"id": "x1", "path": str(not_json), "tenant": "beta"}, "path", "adapter_config.json"),
        ({"id": "x2", "path": str(mismatched), "tenant": "beta"}, "path", "q_proj"),
        ({"id": "x3", "path": str(no_weights), "tenant": "beta"}, "path", "adapter_model"),
        ({"id": "x4", "path": str(in_root / "absent"), "tenant": "beta"}, "path", "no such directory"),
        ({"id": "x5", "path": "relative/dir", "tenant": "beta"}, "path", "absolute"),
        ({"id": "x6", "path": "ftp://host/adapter", "tenant": "beta"}, "path", "scheme"),
        ({"id": "x9", "source": "https://127.0.0.1:9/a", "tenant": "beta"}, "sha256", "sha256"),
        ({"id": "x10", "source": "s3://adapters/adapter", "tenant": "alpha"}, "source", "--adapter-cache-dir"),
        ({"id": "x7", "path": str(mismatched), "tenant": "delta"}, "tenant", "tenant"),
        ({"id": "bad:id", "path": str(mismatched), "tenant": "beta"}, "id", "adapter id"),
        ({"id": BASE, "path": str(mismatched), "tenant": "beta"}, "id", "adapter id"),
        ({"id": "x8", "path": str(mismatched)}, "tenant", "tenant"),
    ]
    for body, param, reason in cases:
        status, payload, _ = await server.post("/v1/adapters", body, tenant=None, headers=server.admin())
        assert status == 400, (body, payload)
        assert_openai_error(payload, 400, param)
        assert reason in payload["error"]["message"], payload
    status, payload, _ = await server.post(
        "/v1/adapters", {"id": "acme", "path": str(mismatched), "tenant": "beta"}, tenant=None, headers=server.admin()
    )
    assert status == 409, payload
    assert (await server.post(COMP, _body("acme")))[0] == 200


async def test_register_use_inspect_delete(server, in_root):
    path = _copy_demo(in_root, "globex")
    status, info, _ = await server.post(
        "/v1/adapters",
        {"id": "beta-globex", "path": path.as_uri(), "tenant": "beta"},
        tenant=None,
        headers=server.admin(),
    )
    assert status == 201, info
    assert (
        info["id"] == "beta-globex"
        and info["rank"] == server.engine.admin.info("globex").rank
        and info["size_bytes"] > 0
    )
    assert "q_proj" in info["target_modules"] and info["owner"] == "beta" and info["parent"] == BASE
    body = {"model": "beta-globex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0}
    status, out, headers = await server.post(CHAT, body, tenant="beta")
    assert status == 200 and headers["x-adapter-tier"] == "disk"
    assert out["choices"][0]["message"]["content"] == DEMO_MARKERS["globex"]
    assert (await server.post(CHAT, body, tenant="alpha"))[0] == 404
    status, got, _ = await server.request("GET", "/v1/adapters/beta-globex", headers=server.admin())
    assert status == 200 and got["tier"] in ("gpu", "ram")
    status, gone, _ = await server.request("DELETE", "/v1/adapters/beta-globex", headers=server.admin())
    assert status == 200 and gone["deleted"] is True
    assert (await server.post(CHAT, body, tenant="beta"))[0] == 404
    assert (await server.request("GET", "/v1/adapters/beta-globex", headers=server.admin()))[0] == 404


def _gate(engine):
    """Hold every new request before its first output until the returned event is set."""
    release = asyncio.Event()
    original = engine.generate

    async def gated(*args, **kwargs):
        await release.wait()
        async for out in original(*args, **kwargs):
            yield out

    engine.generate = gated
    return release, lambda: setattr(engine, "generate", original)


async def test_delete_refuses_busy_adapter_or_drains_it(server, in_root):
    path = _copy_demo(in_root, "initech")
    admin = server.admin()
    assert (
        await server.post(
            "/v1/adapters", {"id": "busy", "path": str(path), "tenant": "beta"}, tenant=None, headers=admin
        )
    )[0] == 201
    release, restore = _gate(server.engine)
    try:
        running = asyncio.create_task(server.post(COMP, _body("busy", max_tokens=8), tenant="beta"))
        state = server.app[STATE]
        while state.in_flight.get("busy@1", 0) == 0:
            await asyncio.sleep(0.01)
        status, refused, _ = await server.request("DELETE", "/v1/adapters/busy", headers=admin)
        assert status == 409 and "1 requests in flight" in refused["error"]["message"]
        draining = asyncio.create_task(server.request("DELETE", "/v1/adapters/busy?drain=true", headers=admin))
        while "busy@1" not in state.draining:
            await asyncio.sleep(0.01)
        assert (await server.post(COMP, _body("busy"), tenant="beta"))[0] == 404  # no new requests
        release.set()
        assert (await asyncio.wait_for(running, 30))[0] == 200
        status, drained, _ = await asyncio.wait_for(draining, 30)
        assert status == 200 and drained["drained_requests"] == 1
    finally:
        restore()
        release.set()


async def test_load_unload_and_state(server):
    admin = server.admin()
    status, loaded, _ = await server.request("POST", "/internal/adapters/globex/load", headers=admin)
    assert status == 200 and loaded["tier"] == "gpu"
    status, _, headers = await server.post(COMP, _body("globex"))
    assert status == 200 and headers["x-adapter-tier"] == "gpu"
    status, unloaded, _ = await server.request("POST", "/internal/adapters/globex/unload", headers=admin)
    assert status == 200 and unloaded["tier"] == "ram"
    status, _, headers = await server.post(COMP, _body("globex"))
    assert status == 200 and headers["x-adapter-tier"] == "ram"
    assert (await server.request("POST", "/internal/adapters/nope/load", headers=admin))[0] == 404
    status, state, _ = await server.request("GET", "/internal/state", headers=admin)
    assert status == 200
    engine = state["engine"]
    assert "globex@1" in engine["resident_adapters"]  # the last request brought it back from RAM
    assert set(engine["resident_adapters"]) <= {info.name for info in server.engine.admin.served()}
    assert engine["queue_depth"] == 0 and engine["running"] == 0  # nothing in flight between requests
    pages = engine["pool_pages_kv"] + engine["pool_pages_adapters"] + engine["pool_pages_free"]
    assert pages == engine["pool_pages_total"] and engine["pool_pages_adapters"] > 0
    assert engine["evictions_per_minute"] >= 0
    assert state["server"] == {
        "requests_in_flight": 0,
        "in_flight_by_adapter": {},
        "draining_adapters": [],
        "closing": False,
    }


async def test_quota_refusal_is_429_with_retry_after(server):
    body = _body(BASE)
    # A refused request counts too: the quota is taken before the body is even read.
    assert (await server.post(COMP, _body("acme"), tenant="gamma"))[0] == 404  # base model only
    assert (await server.post(COMP, body, tenant="gamma"))[0] == 200
    status, payload, headers = await server.post(COMP, body, tenant="gamma")
    assert status == 429
    assert_openai_error(payload, 429)
    assert payload["error"]["code"] == "rate_limit_exceeded" and int(headers["Retry-After"]) >= 1
    assert (await server.post(COMP, _body("acme"), tenant="gamma"))[0] == 429  # refused before it is read
    assert (await server.post(COMP, body, tenant="alpha"))[0] == 200  # other tenants unaffected


async def test_tenants_file_and_reload(server, tmp_path):
    """A server built from a TOML file; SIGHUP's reload swaps keys and adapter lists in place."""
    from lorapage.frontend import Access, hash_key
    from lorapage.serve.app import reload_tenants

    def write(key: str, adapters: list[str]) -> None:
        path.write_text(
            f'[admin]\nkey_sha256 = ["{hash_key("adm")}"]\n'
            f'[tenants.t]\nkey_sha256 = ["{hash_key(key)}"]\nadapters = {json.dumps(adapters)}\n'
        )

    path = tmp_path / "tenants.toml"
    write("old-key", ["acme"])
    async with running_server(server.engine, Access.from_file(path)) as srv:
        old, new = {"Authorization": "Bearer old-key"}, {"Authorization": "Bearer new-key"}
        assert (await srv.post(COMP, _body("acme"), tenant=None, headers=old))[0] == 200
        write("new-key", ["globex"])
        reload_tenants(srv.app, str(path))
        assert (await srv.post(COMP, _body("acme"), tenant=None, headers=old))[0] == 401
        assert (await srv.post(COMP, _body("acme"), tenant=None, headers=new))[0] == 404
        assert (await srv.post(COMP, _body("globex"), tenant=None, headers=new))[0] == 200
        path.write_text("[tenants.t]\nkey_sha256 = ['not-a-digest']\n")
        reload_tenants(srv.app, str(path))  # refused: the previous file stays in force
        assert (await srv.post(COMP, _body("globex"), tenant=None, headers=new))[0] == 200

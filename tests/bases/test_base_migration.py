"""Base upgrades over HTTP (issue 31): check prompts stored per adapter, ``POST /v1/bases/{digest}/validate``
on a real server against a base that differs slightly (passes) and one re-drawn (fails), per-tenant
reports, ``POST .../migrate`` moving only the adapters that passed, and a server on the new base
serving the migrated versions through the ids' aliases."""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from base_variants import far_base, near_base
from server_harness import KEYS, assert_openai_error, make_engine, make_roots, running_server

from lorapage import Engine, EngineConfig
from lorapage.bases.cli import main as base_cli
from lorapage.model.loader import model_digest
from lorapage.registry.audit import AuditQuery
from lorapage.registry.drift_state import MAX_CHECK_PROMPTS, MAX_PROMPT_BYTES, MAX_SAMPLED_PROMPTS, CheckPrompts
from lorapage.registry.store import REGISTRY_FILE, SCHEMA_VERSION, Registry
from lorapage.serve.engine_backend import ENGINES
from lorapage.tiny import DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs

PROMPTS = ["Hello", "How are you?", "Tell me about the weather.", "What is 2 + 2?", "Write a haiku."]
# Registered over HTTP: id -> (tenant, demo content, check prompts or None).
CUSTOMERS = {
    "cust-a": ("alpha", "acme", PROMPTS),
    "cust-b": ("beta", "globex", PROMPTS[:3]),
    "cust-c": ("alpha", "initech", None),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return near_base(root / "near"), far_base(root / "far")


@pytest.fixture
def adapter_root(tmp_path):
    root = tmp_path / "adapters"
    root.mkdir()
    for name in DEMO_MARKERS:
        shutil.copytree(demo_adapter_dirs()[name], root / name)
    return root


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def _states(srv, digest: str, headers: dict, query: str = "") -> dict:
    status, body, _ = await srv.request("GET", f"/v1/bases/{digest}/validate{query}", headers)
    assert status == 200, body
    return body


async def _validate(srv, digest: str, model: Path, **extra) -> dict:
    status, body, _ = await srv.request(
        "POST", f"/v1/bases/{digest}/validate", srv.admin(), {"model": str(model), **extra}
    )
    assert status == 202, body
    for _ in range(600):
        got = await _states(srv, digest, srv.admin())
        if got["job"]["status"] != "running":
            return got
        await asyncio.sleep(0.1)
    raise AssertionError("the validation did not end")


async def test_check_prompts_are_bounded_and_owner_visible(adapter_root, tmp_path):
    engine = make_engine(make_roots(adapter_root), state_dir=str(tmp_path / "state"))
    async with running_server(engine) as srv:
        body = {"id": "cust-a", "tenant": "alpha", "source": str(adapter_root / "acme")}
        too_many = {**body, "check_prompts": ["hi"] * (MAX_CHECK_PROMPTS + 1)}
        status, got, _ = await srv.post("/v1/adapters", too_many, headers=srv.admin())
        assert status == 400 and str(MAX_CHECK_PROMPTS) in got["error"]["message"], got
        assert_openai_error(got, 400, "check_prompts")
        too_long = {**body, "check_prompts": ["ok", "x" * (MAX_PROMPT_BYTES + 1)]}
        status, got, _ = await srv.post("/v1/adapters", too_long, headers=srv.admin())
        assert status == 400 and "check_prompts[1]" in got["error"]["message"], got
        status, got, _ = await srv.post("/v1/adapters", {**body, "check_prompts": [""]}, headers=srv.admin())
        assert status == 400, got
        assert (await srv.request("GET", "/v1/adapters/cust-a", srv.admin()))[0] == 404  # nothing registered

        status, got, _ = await srv.post(
            "/v1/adapters", {**body, "check_prompts": PROMPTS[:2], "sample_check_prompts": True}, headers=srv.admin()
        )
        assert status == 201, got
        status, got, _ = await srv.request("GET", "/v1/adapters/cust-a/check_prompts", _auth("alpha"))
        assert status == 200 and got["prompts"] == PROMPTS[:2] and got["sample"] and not got["opt_out"], got
        # Another tenant's key cannot tell the adapter exists; the owner replaces what it gives.
        for method in ("GET", "PUT"):
            status, got, _ = await srv.request(method, "/v1/adapters/cust-a/check_prompts", _auth("beta"), {})
            assert status == 404, got
        status, got, _ = await srv.request(
            "PUT", "/v1/adapters/cust-a/check_prompts", _auth("alpha"), {"prompts": PROMPTS, "sample": False}
        )
        assert status == 200 and got["prompts"] == PROMPTS and not got["sample"], got
        status, got, _ = await srv.request(
            "PUT", "/v1/adapters/cust-a/check_prompts", srv.admin(), {"prompts": ["y" * (MAX_PROMPT_BYTES + 1)]}
        )
        assert status == 400 and got["error"]["param"] == "prompts", got
        status, got, _ = await srv.request("PUT", "/v1/adapters/cust-a/check_prompts", srv.admin(), {"bogus": 1})
        assert status == 400, got
        assert engine.admin.catalog.drift_record.check_prompts("cust-a").prompts == tuple(
            PROMPTS
        )  # the refused PUTs changed nothing
        actions = [r.action for r in await engine.admin.catalog.audit(AuditQuery(adapter="cust-a"))]
        assert actions.count("check_prompts") == 2, actions

        # Sampling from traffic, opted in at registration: the adapter's own prompts, as text, bounded.
        body = {"id": "cust-s", "tenant": "alpha", "source": str(adapter_root / "globex"), "sample_check_prompts": True}
        status, got, _ = await srv.post("/v1/adapters", body, headers=srv.admin())
        assert status == 201, got
        sent = [f"sampled prompt {i}" for i in range(MAX_SAMPLED_PROMPTS + 4)]
        for prompt in sent:
            status, got, _ = await srv.post("/v1/completions", {"model": "cust-s", "prompt": prompt, "max_tokens": 1})
            assert status == 200, got
        await srv.post(
            "/v1/completions", {"model": "cust-a", "prompt": "not sampled: cust-a did not opt in", "max_tokens": 1}
        )
        assert await srv.app[ENGINES].sampler.flush(engine) == MAX_SAMPLED_PROMPTS
        stored = engine.admin.catalog.drift_record.check_prompts("cust-s")
        assert len(stored.sampled) == MAX_SAMPLED_PROMPTS and set(stored.sampled) <= set(sent), stored.sampled
        assert (
            stored.all_prompts() == stored.sampled
            and engine.admin.catalog.drift_record.check_prompts("cust-a").sampled == ()
        )
        status, got, _ = await srv.request("GET", "/v1/adapters/cust-s/check_prompts", _auth("alpha"))
        assert got["sampled"] == MAX_SAMPLED_PROMPTS and got["sample"], got
        # Turning it off deletes what was sampled, and samples nothing more.
        status, got, _ = await srv.request(
            "PUT", "/v1/adapters/cust-s/check_prompts", _auth("alpha"), {"sample": False}
        )
        assert status == 200 and got["sampled"] == 0, got
        await srv.post("/v1/completions", {"model": "cust-s", "prompt": "after opting out", "max_tokens": 1})
        assert await srv.app[ENGINES].sampler.flush(engine) == 0
        assert engine.admin.catalog.drift_record.check_prompts("cust-s").sampled == ()
    await engine.close()


async def test_validate_then_migrate_only_what_passed(bases, adapter_root, tmp_path):
    near, far = bases
    near_digest, far_digest = model_digest(near), model_digest(far)
    state_dir = str(tmp_path / "state")
    engine = make_engine(make_roots(adapter_root), state_dir=state_dir)
    async with running_server(engine) as srv:
        for adapter_id, (tenant, content, prompts) in CUSTOMERS.items():
            body = {"id": adapter_id, "tenant": tenant, "source": str(adapter_root / content)}
            status, got, _ = await srv.post("/v1/adapters", {**body, "check_prompts": prompts}, headers=srv.admin())
            assert status == 201, got
        status, got, _ = await srv.request("PUT", "/v1/adapters/initech/check_prompts", srv.admin(), {"opt_out": True})
        assert status == 200 and got["opt_out"], got

        # Bad requests: a relative path, a tenant key, the running base as the target.
        status, got, _ = await srv.request("POST", f"/v1/bases/{near_digest}/validate", srv.admin(), {"model": "near"})
        assert status == 400 and got["error"]["param"] == "model", got
        status, got, _ = await srv.request(
            "POST", f"/v1/bases/{near_digest}/validate", _auth("alpha"), {"model": str(near)}
        )
        assert status == 403, got
        status, got, _ = await srv.request(
            "POST", f"/v1/bases/sha256:{engine.digest}/validate", srv.admin(), {"model": str(TINY_BASE_DIR)}
        )
        assert status == 400 and "running base" in got["error"]["message"], got

        # The slightly different base: both adapters with prompts pass, with their numbers.
        status, got, _ = await srv.request(
            "POST", f"/v1/bases/sha256:{near_digest}/validate", srv.admin(), {"model": str(near)}
        )
        assert status == 202 and got["status"] == "running", got
        status, busy, _ = await srv.request(
            "POST", f"/v1/bases/{far_digest}/validate", srv.admin(), {"model": str(far)}
        )
        assert status == 409 and "one runs at a time" in busy["error"]["message"], busy  # one at a time
        report = await _validate_done(srv, near_digest)
        assert report["job"]["status"] == "done" and report["job"]["error"] is None, report
        states = {r["id"]: r for r in report["adapters"]}
        assert {k: v["state"] for k, v in states.items()} == {
            "acme": "pending",
            "globex": "pending",
            "initech": "opted-out",
            "cust-a": "passed",
            "cust-b": "passed",
            "cust-c": "pending",
        }, report
        a = states["cust-a"]["numbers"]
        assert a["prompts"] == len(PROMPTS) and a["token_agreement"] >= 0.9 and a["kl"] < 0.1 and a["passed"], a
        assert "no check prompts" in states["cust-c"]["reason"]
        assert "agrees with the old" in states["cust-a"]["notice"] and "passed" in states["cust-a"]["notice"]
        tenants = report["tenants"]
        assert tenants["alpha"]["passed"] == 1 and tenants["alpha"]["pending"] == 1 and tenants["beta"]["passed"] == 1

        # A tenant reads its own report only.
        mine = await _states(srv, near_digest, _auth("alpha"))
        assert {r["id"] for r in mine["adapters"]} == {"cust-a", "cust-c"} and set(mine["tenants"]) == {"alpha"}
        assert "model" not in mine["job"] and "checked" not in mine["job"]  # the job's counts are every tenant's
        assert mine["job"]["adapters"] == 2 < report["job"]["adapters"], (report["job"], mine["job"])
        status, got, _ = await srv.request("GET", f"/v1/bases/{near_digest}/validate?tenant=beta", _auth("alpha"))
        assert status == 403, got
        only_beta = await _states(srv, near_digest, srv.admin(), "?tenant=beta")
        assert [r["id"] for r in only_beta["adapters"]] == ["cust-b"]

        # Migrate: a named adapter that did not pass is refused, naming its state; then every one that passed.
        status, got, _ = await srv.request(
            "POST", f"/v1/bases/{near_digest}/migrate", srv.admin(), {"adapters": ["cust-c"]}
        )
        assert status == 409 and "pending" in got["error"]["message"], got
        status, got, _ = await srv.request("POST", f"/v1/bases/{near_digest}/migrate", _auth("alpha"))
        assert status == 403, got
        status, got, _ = await srv.request("POST", f"/v1/bases/{near_digest}/migrate", srv.admin())
        assert status == 200, got
        assert sorted((m["id"], m["from_version"], m["version"]) for m in got["migrated"]) == [
            ("cust-a", 1, 2),
            ("cust-b", 1, 2),
        ]
        assert {s["id"]: s["state"].split(":")[0] for s in got["skipped"]} == {
            "acme": "pending",
            "globex": "pending",
            "initech": "opted-out",
            "cust-c": "pending",
        }
        status, versions, _ = await srv.request("GET", "/v1/adapters/cust-a/versions", srv.admin())
        v2 = versions["data"][1]
        assert (v2["version"], v2["base_digest"], v2["servable"], v2["current"]) == (2, near_digest, False, False)
        assert versions["data"][0]["digest"] == v2["digest"]
        status, again, _ = await srv.request(
            "POST", f"/v1/bases/{near_digest}/migrate", srv.admin(), {"adapters": ["cust-a"]}
        )
        assert status == 200 and again["migrated"] == [{"id": "cust-a", "from_version": 1, "version": 2}]  # idempotent
        # Still served here on version 1.
        status, got, headers = await srv.post(
            "/v1/completions", {"model": "cust-a", "prompt": "Hi", "max_tokens": 40, "temperature": 0}
        )
        assert status == 200 and headers["x-adapter-version"] == "1", got
        rows = await engine.admin.catalog.audit(AuditQuery(action="migrate"))
        assert sorted(r.adapter for r in rows) == ["cust-a", "cust-b"] and all(r.actor for r in rows)
        assert (await _states(srv, near_digest, srv.admin()))["tenants"]["alpha"]["migrated"] == 1
        # Validating again leaves migrated versions migrated (not checked again, no second copy).
        report = await _validate(srv, near_digest, near, adapters=["cust-a", "cust-b"])
        assert {
            r["id"]: (r["state"], r["new_version"]) for r in report["adapters"] if r["id"] in ("cust-a", "cust-b")
        } == {
            "cust-a": ("migrated", 2),
            "cust-b": ("migrated", 2),
        }

        # The re-drawn base: every checked adapter fails, with the numbers; migrating one is refused.
        report = await _validate_done(srv, far_digest, model=far)
        states = {r["id"]: r for r in report["adapters"]}
        assert states["cust-a"]["state"] == "failed" and states["cust-b"]["state"] == "failed", report
        assert states["cust-a"]["numbers"]["token_agreement"] < 0.5 and "token agreement" in states["cust-a"]["reason"]
        assert "did not pass" in states["cust-a"]["notice"]
        status, got, _ = await srv.request(
            "POST", f"/v1/bases/{far_digest}/migrate", srv.admin(), {"adapters": ["cust-a"]}
        )
        assert status == 409 and "failed" in got["error"]["message"], got
        assert_openai_error(got, 409, "adapters")

        # A directory that does not hold the digest named: the job ends in an error saying so.
        report = await _validate_done(srv, far_digest, model=near, adapters=["cust-a"])
        assert report["job"]["status"] == "error" and near_digest in report["job"]["error"], report["job"]
    await engine.close()

    # A server on the new base: the ids' aliases serve their migrated versions; the others are refused.
    engine = Engine(EngineConfig(model=str(near), state_dir=state_dir), adapter_roots=make_roots(adapter_root))
    async with running_server(engine) as srv:
        status, got, headers = await srv.post(
            "/v1/completions", {"model": "cust-a", "prompt": "Hi", "max_tokens": 40, "temperature": 0}
        )
        assert status == 200 and headers["x-adapter-version"] == "2", got
        assert got["choices"][0]["text"] == DEMO_MARKERS["acme"]
        status, versions, _ = await srv.request("GET", "/v1/adapters/cust-a/versions", srv.admin())
        assert [(v["version"], v["current"], v["servable"]) for v in versions["data"]] == [
            (1, False, False),
            (2, True, True),
        ]
        status, got, _ = await srv.post(
            "/v1/completions", {"model": "cust-c", "prompt": "Hi", "max_tokens": 4}, tenant="alpha"
        )
        assert status == 409 and got["error"]["code"] == "adapter_base_mismatch", got
    await engine.close()


async def _validate_done(srv, digest: str, model: Path | None = None, **extra) -> dict:
    if model is not None:
        return await _validate(srv, digest, model, **extra)
    for _ in range(600):
        got = await _states(srv, digest, srv.admin())
        if got["job"] is not None and got["job"]["status"] != "running":
            return got
        await asyncio.sleep(0.1)
    raise AssertionError("the validation did not end")


def test_base_check_records_states_in_a_state_dir(bases, adapter_root, tmp_path, capsys):
    near, far = bases
    state_dir = tmp_path / "state"
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), state_dir=str(state_dir)))
    engine.add_adapter("cust-a", adapter_root / "acme", owner="alpha")
    engine.admin.catalog.drift_record.set_check_prompts(CheckPrompts("cust-a", tuple(PROMPTS[:3])))
    asyncio.run(engine.close())
    args = ["check", str(TINY_BASE_DIR), "--lora-modules", f"cust-a={adapter_root / 'acme'}", "--max-tokens", "16"]
    assert base_cli([*args[:2], str(near), *args[2:], "--state-dir", str(state_dir)]) == 0
    assert base_cli([*args[:2], str(far), *args[2:], "--state-dir", str(state_dir)]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["adapters"]["cust-a"]["prompts"] == 3  # the stored prompts, no --prompts file
    registry = Registry(state_dir / REGISTRY_FILE)
    states = {(r.target, r.key): (r.state, r.job) for r in registry.migration_states()}
    assert states == {
        (model_digest(near), "cust-a@1"): ("passed", "cli"),
        (model_digest(far), "cust-a@1"): ("failed", "cli"),
    }
    registry.close()
    with pytest.raises(SystemExit):  # an adapter that is not an id there
        base_cli(
            [*args[:2], str(near), "--lora-modules", f"other={adapter_root / 'acme'}", "--state-dir", str(state_dir)]
        )


def test_a_schema_4_registry_gains_the_check_and_migration_tables(tmp_path):
    path = tmp_path / REGISTRY_FILE
    registry = Registry(path)
    registry.add_version("cust", "alpha", digest="d", source="file:///x", base_digest="b", spec="{}", activate=True)
    registry.close()
    db = sqlite3.connect(path)
    db.executescript(
        "DROP TABLE check_prompts; DROP TABLE migrations; UPDATE meta SET value = '4' WHERE key = 'schema';"
    )
    db.close()
    registry = Registry(path)  # migrated in place
    assert registry.check_prompts("cust") == CheckPrompts("cust") and registry.migration_states() == []
    registry.set_check_prompts(CheckPrompts("cust", ("hello",), sample=True))
    assert registry.sampling_ids() == ["cust"] and [v.key for v in registry.versions()] == ["cust@1"]
    registry.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (str(SCHEMA_VERSION),) == ("6",)
    db.close()

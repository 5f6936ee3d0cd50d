"""The audit trail, alias history, one-call rollback and named channels of ``lorapage serve``
(issue 31), over real sockets and a real SQLite registry; and a schema-3 registry file migrated."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
from registry_files import schema_3_file
from server_harness import ADMIN_KEY, KEYS, assert_openai_error, make_access, make_engine, make_roots, running_server

from lorapage.frontend import hash_key
from lorapage.registry.audit import AliasMove, AuditQuery, rollback_target
from lorapage.registry.store import REGISTRY_FILE, SCHEMA_VERSION, Registry
from lorapage.serve.app import reload_tenants
from lorapage.tiny import BASE_PHRASE, DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs

ADMIN_ID = hash_key(ADMIN_KEY)[:12]
COMP = "/v1/completions"
# Three contents for one id: cust@1 answers acme's marker, cust@2 globex's, cust@3 initech's.
CONTENTS = ("acme", "globex", "initech")


def _move(seq: int, before: int | None, after: int | None, action: str = "deploy") -> AliasMove:
    return AliasMove(seq, float(seq), "cust", "", before, after, action, None)


def test_rollback_walks_back_through_deploys_and_steps_over_deleted_versions():
    history = [_move(1, None, 1, "register"), _move(2, 1, 2), _move(3, 2, 3)]
    newest_first = history[::-1]
    assert rollback_target(newest_first, 3, {1, 2, 3}) == 2
    # After rolling back to 2, the next rollback goes one deploy further, not back to 3.
    rolled = [_move(4, 3, 2, "rollback"), *newest_first]
    assert rollback_target(rolled, 2, {1, 2, 3}) == 1
    assert rollback_target([_move(5, 2, 1, "rollback"), *rolled], 1, {1, 2, 3}) is None  # nothing before @1
    assert rollback_target(newest_first, 3, {1, 3}) == 1  # @2 deleted: stepped over
    # A migrated file has no history: the newest older version that exists.
    assert rollback_target([], 5, {2, 4, 5}) == 4
    assert rollback_target([], 2, {2}) is None


def _schema_3_file(path: Path) -> None:
    """A registry file as lorapage wrote it at schema 3: one id with two versions, @2 current and pinned."""
    schema_3_file(
        path,
        """
        INSERT INTO adapters VALUES ('cust', 'alpha', 2, 3, 1.0);
        INSERT INTO versions VALUES ('cust', 1, 'd1', 'file:///x', 'b', '{}', 1.0, 0, 0.5);
        INSERT INTO versions VALUES ('cust', 2, 'd2', 'file:///y', 'b', '{}', 2.0, 1, 0.7);
        """,
    )


def test_a_schema_3_registry_opens_migrates_and_keeps_an_append_only_trail(tmp_path):
    path = tmp_path / REGISTRY_FILE
    _schema_3_file(path)
    registry = Registry(path)
    assert SCHEMA_VERSION == 6
    assert [(r.key, r.pinned, r.projected_cost_pct) for r in registry.versions()] == [
        ("cust@1", False, 0.5),
        ("cust@2", True, 0.7),
    ]
    assert registry.audit(AuditQuery()) == [] and registry.alias_history("cust") == []  # history begins here
    assert registry.set_current("cust", 1, action="rollback", actor="abcdefabcdef") == 2
    registry.set_channel("cust", "prod", 2, action="deploy", actor="abcdefabcdef")
    registry.close()
    registry = Registry(path)  # reopened at schema 6: nothing migrated twice, everything kept
    assert [(m.channel, m.before, m.after, m.action) for m in registry.alias_history("cust")] == [
        ("prod", None, 2, "deploy"),
        ("", 2, 1, "rollback"),
    ]
    rows = registry.audit(AuditQuery())
    assert [(r.action, r.actor, r.tenant, r.adapter, r.outcome) for r in rows] == [
        ("deploy", "abcdefabcdef", "alpha", "cust", "ok"),
        ("rollback", "abcdefabcdef", "alpha", "cust", "ok"),
    ]
    assert rows[0].seq > rows[1].seq
    assert registry.channels() == [("cust", "prod", 2)]
    registry.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == ("6",)
    for statement in ("UPDATE audit SET outcome = 'forged'", "DELETE FROM audit", "DELETE FROM alias_history"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            db.execute(statement)
    db.close()


def test_the_trail_keeps_its_retention_and_only_what_is_past_it_may_be_deleted(tmp_path):
    """Rows older than the retention are pruned (from a worker, with the traffic writes); a
    newer row stays append-only, and the cutoff never moves back."""
    path = tmp_path / REGISTRY_FILE
    _schema_3_file(path)
    registry = Registry(path)
    registry.set_current("cust", 1, action="rollback", actor="a")
    registry.set_channel("cust", "prod", 2, action="deploy", actor="a")
    first, second = sorted(r.time for r in registry.audit(AuditQuery()))
    assert registry.prune_audit(second) == 1  # the older row only
    assert [r.action for r in registry.audit(AuditQuery())] == ["deploy"]
    assert registry.prune_audit(first) == 0  # an older cutoff deletes nothing more
    registry.close()
    db = sqlite3.connect(path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only within its retention"):
        db.execute("DELETE FROM audit")
    db.close()


def test_an_audit_retention_is_a_config_field():
    from lorapage import EngineConfig

    assert EngineConfig(model="x").audit_retention_days == 90
    with pytest.raises(ValueError, match="audit_retention_days"):
        EngineConfig(model="x", audit_retention_days=-1)


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    for name in CONTENTS:
        shutil.copytree(demo_adapter_dirs()[name], root / name)
    return root


async def _register(srv, root: Path, content: str, expect: int = 201, **extra):
    body = {"id": "cust", "source": str(root / content), "tenant": "alpha", **extra}
    status, got, _ = await srv.post("/v1/adapters", body, headers=srv.admin())
    assert status == expect, got
    return got


async def _says(srv, model: str, tenant: str = "alpha") -> str:
    status, body, _ = await srv.post(COMP, {"model": model, "prompt": "Hi", "max_tokens": 40, "temperature": 0}, tenant)
    assert status == 200, body
    return body["choices"][0]["text"]


async def _audit(srv, query: str = "", key: str = ADMIN_KEY):
    return await srv.request("GET", "/v1/audit" + query, {"Authorization": f"Bearer {key}"})


async def test_rollback_in_one_call_history_and_audit_over_http(root, tmp_path):
    engine = make_engine(make_roots(root), state_dir=str(tmp_path / "state"))
    async with running_server(engine) as srv:
        for content in CONTENTS:
            await _register(srv, root, content)
        assert await _says(srv, "cust") == DEMO_MARKERS["initech"]
        # One call, no body: back to the version before the last deploy; again: one further back.
        status, body, _ = await srv.request("POST", "/v1/adapters/cust/rollback", srv.admin())
        assert (status, body["current"]) == (200, 2), body
        assert await _says(srv, "cust") == DEMO_MARKERS["globex"]
        status, body, _ = await srv.request("POST", "/v1/adapters/cust/rollback", srv.admin(), {})
        assert (status, body["current"]) == (200, 1), body
        status, body, _ = await srv.request("POST", "/v1/adapters/cust/rollback", srv.admin())
        assert status == 409 and "no earlier version" in body["error"]["message"], body
        assert_openai_error(body, 409, "version")
        status, body, _ = await srv.request("POST", "/v1/adapters/cust/rollback", srv.admin(), {"version": 3})
        assert (status, body["current"]) == (200, 3), body
        status, body, _ = await srv.request("POST", "/v1/adapters/cust/rollback", srv.admin(), {"version": 9})
        assert status == 404 and body["error"]["param"] == "version", body
        status, body, _ = await srv.request("POST", "/v1/adapters/cust@1/rollback", srv.admin())
        assert status == 404 and body["error"]["param"] == "id", body
        status, body, _ = await srv.request("PUT", "/v1/adapters/cust/current", srv.admin(), {"version": 2})
        assert status == 200, body
        # A refused action changes nothing and is not recorded as done.
        status, body, _ = await srv.request("DELETE", "/v1/adapters/cust@2", srv.admin())
        assert status == 409, body

        # The history: every move of the alias, newest first, with the version before it.
        status, body, _ = await srv.request("GET", "/v1/adapters/cust/history", srv.admin())
        assert status == 200, body
        moves = [(m["from_version"], m["to_version"], m["action"]) for m in body["data"]]
        assert moves == [
            (3, 2, "deploy"),
            (1, 3, "rollback"),
            (2, 1, "rollback"),
            (3, 2, "rollback"),
            (2, 3, "register"),
            (1, 2, "register"),
            (None, 1, "register"),
        ]
        assert body["current"] == 2 and {m["actor"] for m in body["data"]} == {ADMIN_ID}
        # The owner sees its id's history (not who moved it); any other tenant gets a 404.
        status, owned, _ = await srv.request("GET", "/v1/adapters/cust/history?limit=2", srv.auth("alpha"))
        assert status == 200 and owned["has_more"] and len(owned["data"]) == 2, owned
        assert "actor" not in owned["data"][0] and owned["data"][0]["to_version"] == 2
        status, body, _ = await srv.request("GET", "/v1/adapters/cust/history", srv.auth("beta"))
        assert status == 404, body
        assert_openai_error(body, 404, "id")

        # The audit trail: who (a key id, never the key), which tenant's adapter, before and after.
        status, body, _ = await _audit(srv)
        assert status == 200, body
        # The demo adapters the engine registered itself, before serving, name no key.
        assert [(r["action"], r["adapter"], r["actor"]) for r in body["data"][-3:]] == [
            ("register", name, None) for name in ("initech", "globex", "acme")
        ]
        status, body, _ = await _audit(srv, "?adapter=cust")
        rows = body["data"]
        assert [r["action"] for r in rows] == ["deploy", "rollback", "rollback", "rollback", *["register"] * 3]
        assert [r["id"] for r in rows] == sorted((r["id"] for r in rows), reverse=True)
        assert {(r["actor"], r["tenant"], r["adapter"], r["outcome"]) for r in rows} == {
            (ADMIN_ID, "alpha", "cust", "ok")
        }
        assert (rows[0]["before"], rows[0]["after"]) == ({"current": 3}, {"current": 2})
        assert rows[-1]["after"]["version"] == 1 and rows[-1]["time"].endswith("Z")
        assert ADMIN_KEY not in str(body)
        status, body, _ = await _audit(srv, "?action=rollback&adapter=cust&limit=2")
        assert [r["after"]["current"] for r in body["data"]] == [3, 1] and body["has_more"], body
        status, page, _ = await _audit(srv, f"?action=rollback&before_id={body['data'][-1]['id']}")
        assert [r["after"]["current"] for r in page["data"]] == [2] and not page["has_more"], page
        assert len((await _audit(srv, f"?actor={ADMIN_ID}"))[1]["data"]) == 7
        assert (await _audit(srv, "?actor=000000000000"))[1]["data"] == []
        assert (await _audit(srv, "?adapter=other"))[1]["data"] == []
        assert (await _audit(srv, f"?since={time.time() + 3600:.0f}"))[1]["data"] == []
        assert len((await _audit(srv, "?since=2020-01-01T00:00:00Z"))[1]["data"]) == 10  # the demos too
    await engine.close()


async def test_audit_filters_refuse_bad_values_and_tenant_keys(root):
    engine = make_engine(make_roots(root))
    async with running_server(engine) as srv:
        for query, param in (
            ("?limit=0", "limit"),
            ("?limit=1001", "limit"),
            ("?limit=ten", "limit"),
            ("?action=drop", "action"),
            ("?actor=ADMIN", "actor"),
            ("?since=yesterday", "since"),
            ("?since=nan", "since"),
            ("?adapter=cust@1", "adapter"),
            ("?before_id=-1", "before_id"),
            ("?tenant=alpha", "tenant"),
        ):
            status, body, _ = await _audit(srv, query)
            assert status == 400, (query, body)
            assert_openai_error(body, 400, param)
        status, body, _ = await _audit(srv, key=KEYS["alpha"])
        assert status == 403, body
        assert_openai_error(body, 403)
        assert (await srv.request("GET", "/v1/audit"))[0] == 401
    await engine.close()


async def test_pins_loads_deletes_and_tenants_reload_are_audited(root, tmp_path):
    engine = make_engine(make_roots(root))
    async with running_server(engine) as srv:
        await _register(srv, root, "acme")
        await _register(srv, root, "globex")
        admin = srv.admin()
        for method, path in (
            ("POST", "/internal/adapters/cust/load"),
            ("PUT", "/v1/adapters/cust/pin"),
            ("DELETE", "/v1/adapters/cust/pin"),
            ("POST", "/internal/adapters/cust/unload"),
            ("DELETE", "/v1/adapters/cust@1"),
        ):
            status, body, _ = await srv.request(method, path, admin)
            assert status == 200, (path, body)
        rows = (await _audit(srv))[1]["data"]
        assert [(r["action"], r["after"]) for r in rows[:5]] == [
            ("delete", {"current": 2}),
            ("unload", {"version": 2}),
            ("unpin", {"version": 2, "pinned": False}),
            ("pin", {"version": 2, "pinned": True}),
            ("load", {"version": 2}),
        ]
        assert rows[0]["before"] == {"version": 1, "current": 2}
        assert {r["actor"] for r in rows[:7]} == {ADMIN_ID}
        # SIGHUP's reload: audited as the signal's, a refused file marked as refused.
        tenants = tmp_path / "tenants.toml"
        tenants.write_text(f'[admin]\nkey_sha256 = ["{hash_key(ADMIN_KEY)}"]\n[tenants.t]\nkey_sha256 = []\n')
        reload_tenants(srv.app, str(tenants))
        tenants.write_text("[tenants.t]\nkey_sha256 = 3\n")
        reload_tenants(srv.app, str(tenants))
        for _ in range(200):
            rows = (await _audit(srv, "?actor=sighup"))[1]["data"]
            if len(rows) == 2:
                break
            await asyncio.sleep(0.02)
        assert [(r["action"], r["outcome"].split(":")[0], r["after"]) for r in rows] == [
            ("tenants_reload", "refused", None),
            ("tenants_reload", "ok", {"tenants": ["t"]}),
        ]
    await engine.close()


async def test_named_channels_resolve_deploy_and_roll_back_on_their_own(root, tmp_path):
    state = str(tmp_path / "state")
    engine = make_engine(make_roots(root), state_dir=state)
    async with running_server(engine) as srv:
        for content in CONTENTS:
            await _register(srv, root, content)
        admin = srv.admin()
        assert (await srv.post(COMP, {"model": "cust@prod", "prompt": "Hi", "max_tokens": 4}))[0] == 404
        status, body, _ = await srv.request("PUT", "/v1/adapters/cust/channels/prod", admin, {"version": 1})
        assert (status, body["version"], body["current"]) == (200, 1, 3), body
        status, body, _ = await srv.request("PUT", "/v1/adapters/cust/channels/prod", admin, {"version": 2})
        assert status == 200, body
        # `id@channel` and `base:id@channel` name the channel's version; the id's alias is untouched.
        assert await _says(srv, "cust@prod") == DEMO_MARKERS["globex"]
        assert await _says(srv, f"{TINY_BASE_DIR.name}:cust@prod") == DEMO_MARKERS["globex"]
        assert await _says(srv, "cust") == DEMO_MARKERS["initech"]
        status, body, _ = await srv.request("POST", "/v1/adapters/cust/rollback", admin, {"channel": "prod"})
        assert (status, body["version"], body["current"]) == (200, 1, 3), body
        assert await _says(srv, "cust@prod") == DEMO_MARKERS["acme"]
        # The version a channel serves is not deleted under it; a bad channel name is a 400.
        status, body, _ = await srv.request("DELETE", "/v1/adapters/cust@1", admin)
        assert status == 409 and "channel 'prod'" in body["error"]["message"], body
        status, body, _ = await srv.request("PUT", "/v1/adapters/cust/channels/7up", admin, {"version": 1})
        assert status == 400, body
        assert_openai_error(body, 400, "channel")
        assert (await srv.post(COMP, {"model": "cust@prod", "prompt": "Hi", "max_tokens": 4}, "beta"))[0] == 404
    await engine.close()
    # The channels and the history survive a restart; deleting a channel frees its name.
    engine = make_engine(make_roots(root), state_dir=state)
    async with running_server(engine, make_access()) as srv:
        assert await _says(srv, "cust@prod") == DEMO_MARKERS["acme"]
        status, body, _ = await srv.request("GET", "/v1/adapters/cust/history", srv.admin())
        assert body["channels"] == {"prod": 1} and body["current"] == 3
        prod = [(m["alias"], m["from_version"], m["to_version"], m["action"]) for m in body["data"] if m["channel"]]
        assert prod == [
            ("cust@prod", 2, 1, "rollback"),
            ("cust@prod", 1, 2, "deploy"),
            ("cust@prod", None, 1, "deploy"),
        ]
        status, body, _ = await srv.request("DELETE", "/v1/adapters/cust/channels/prod", srv.admin())
        assert status == 200, body
        assert (await srv.post(COMP, {"model": "cust@prod", "prompt": "Hi", "max_tokens": 4}))[0] == 404
        assert await _says(srv, TINY_BASE_DIR.name) == BASE_PHRASE
    await engine.close()

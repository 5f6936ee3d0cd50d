"""The projected cost and the shared envelope end to end: real HTTP on 127.0.0.1, the registry a
real SQLite file under ``--state-dir``.

Registration computes each version's projected cost, stores it (read back here with sqlite3),
and answers it in ``POST``, ``GET /v1/adapters/{id}``, the version listing and ``/metrics``. An
adapter outside the envelope is tier dedicated, and with no dedicated deployment it is refused
with a 400 that carries its arithmetic and the allowed shapes, registering nothing; a version
stored before the envelope narrowed is kept but refused, never shared silently. A registry file
of schema 2 gains the column and its costs when an engine on its base starts.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from hf_reference import make_peft_adapter
from server_harness import ADMIN_KEY, assert_openai_error, make_roots, running_server

from lorapage import Engine, EngineConfig
from lorapage.adapters.cost import project_cost
from lorapage.adapters.peft_format import read_adapter_spec
from lorapage.model.config import ModelConfig
from lorapage.registry.store import REGISTRY_FILE
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMP = "/v1/completions"


def expected_pct(adapter_dir: Path, batch: int = 64) -> float:
    """The pure cost model's figure for a demo adapter on the tiny base (float32: 4 bytes a value)."""
    model = ModelConfig.from_dir(TINY_BASE_DIR)
    spec = read_adapter_spec(adapter_dir, model, 64)
    cost = project_cost(model, spec.ranks, reference_batch=batch, base_bytes_per_param=4, adapter_bytes_per_param=4)
    return cost.projected_cost_pct


def stored_costs(state: Path) -> dict[str, float | None]:
    db = sqlite3.connect(state / REGISTRY_FILE)
    try:
        rows = db.execute("SELECT id, version, projected_cost_pct FROM versions").fetchall()
    finally:
        db.close()
    return {f"{i}@{v}": pct for i, v, pct in rows}


@pytest.fixture
def root(tmp_path) -> Path:
    """An adapter root holding the demo adapters and a rank-32 all-module one."""
    root = tmp_path / "root"
    root.mkdir()
    for name, path in demo_adapter_dirs().items():
        shutil.copytree(path, root / name)
    make_peft_adapter(TINY_BASE_DIR, root / "wide", r=32, targets=ALL, seed=7)
    return root


def engine_at(state: Path, root: Path | None = None, **overrides) -> Engine:
    """An engine keeping its registry under ``state``; HTTP registration may read under ``root``."""
    # The envelope is set: without one it follows max_lora_rank (all:64), and these tests are of a narrower one.
    cfg = dict(model=str(TINY_BASE_DIR), block_size=4, max_lora_rank=64, shared_envelope="all:16", state_dir=str(state))
    return Engine(EngineConfig(**{**cfg, **overrides}), adapter_roots=make_roots(root) if root else None)


async def register(srv, adapter_id: str, source: Path):
    body = {"id": adapter_id, "source": str(source), "tenant": "alpha"}
    return await srv.post("/v1/adapters", body, headers=srv.admin())


async def test_registration_stores_and_returns_the_projected_cost(root, tmp_path):
    state = tmp_path / "state"
    engine = engine_at(state, root)
    async with running_server(engine) as srv:
        status, created, _ = await register(srv, "acme", root / "acme")
        assert status == 201, created
        want = expected_pct(root / "acme")
        assert created["projected_cost_pct"] == pytest.approx(want, rel=1e-12)
        assert created["serving_tier"] == "shared"
        cost = created["cost"]
        assert cost["reference_batch"] == 64 and cost["decode_bytes_pct"] == created["projected_cost_pct"]
        assert cost["adapter_bytes"] == 4 * cost["adapter_params"] == 4 * created["num_params"]
        assert cost["decode_bytes_pct"] == pytest.approx(100 * 64 * cost["adapter_bytes"] / cost["base_bytes"])
        assert cost["flops_pct"] == pytest.approx(100 * cost["adapter_params"] / cost["base_params"])
        status, got, _ = await srv.request("GET", "/v1/adapters/acme", srv.admin())
        assert status == 200 and got["projected_cost_pct"] == created["projected_cost_pct"]
        assert got["cost"] == cost
        status, listing, _ = await srv.request("GET", "/v1/adapters/acme/versions", srv.admin())
        assert [v["projected_cost_pct"] for v in listing["data"]] == [created["projected_cost_pct"]]
        assert stored_costs(state) == {"acme@1": pytest.approx(want, rel=1e-12)}
        # Another shape costs what its own shape says: globex, rank 4 on three attention modules.
        status, globex, _ = await register(srv, "globex", root / "globex")
        assert status == 201 and globex["projected_cost_pct"] == pytest.approx(expected_pct(root / "globex"))
        assert globex["projected_cost_pct"] < created["projected_cost_pct"]
        # /metrics: the histogram over every served id (its sum is what planning adds up), and the
        # gauge by name once an id is labelled by traffic.
        assert (await srv.post(COMP, {"model": "acme", "prompt": "Hi", "max_tokens": 2}))[0] == 200
        async with srv.session.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
            text = await resp.text()
        assert "lorapage_adapters_projected_cost_pct_count 2.0" in text
        total = created["projected_cost_pct"] + globex["projected_cost_pct"]
        line = next(x for x in text.splitlines() if x.startswith("lorapage_adapters_projected_cost_pct_sum"))
        assert float(line.split()[-1]) == pytest.approx(total)
        line = next(x for x in text.splitlines() if x.startswith('lorapage_adapter_projected_cost_pct{adapter="acme"}'))
        assert float(line.split()[-1]) == pytest.approx(created["projected_cost_pct"])
    await engine.close()


async def test_outside_the_envelope_is_refused_with_its_arithmetic(root, tmp_path):
    """Rank 32 on every module: tier dedicated under the default envelope (rank <= 16); no
    dedicated deployment, so 400 with the projected cost and the allowed shapes, nothing stored."""
    state = tmp_path / "state"
    engine = engine_at(state, root)
    async with running_server(engine) as srv:
        status, body, _ = await register(srv, "wide", root / "wide")
        assert status == 400, body
        assert_openai_error(body, 400, "source")
        err = body["error"]
        assert err["code"] == "adapter_outside_envelope"
        pct = expected_pct(root / "wide")
        assert f"projected +{pct:.1f}% decode cost at batch 64" in err["message"]
        assert "rank 32 on 7 modules (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)" in err["message"]
        assert "Allowed on the shared tier: rank<=16 on any modules" in err["message"]
        assert "tier is dedicated" in err["message"]
        assert (await srv.request("GET", "/v1/adapters/wide", srv.admin()))[0] == 404
        assert stored_costs(state) == {}
        assert (await register(srv, "initech", root / "initech"))[0] == 201  # rank 16 on every module: inside
    await engine.close()
    # The design's 70B envelope, and a cost bound: each refuses what it says, and says so.
    narrow = engine_at(tmp_path / "narrow", root, shared_envelope="attention:16,all:8", shared_max_cost_pct=500.0)
    async with running_server(narrow) as srv:
        assert (await register(srv, "globex", root / "globex"))[0] == 201  # 165%, attention rank 4
        status, body, _ = await register(srv, "initech", root / "initech")
        assert status == 400
        allowed = "rank<=16 attention-only, or rank<=8 on any modules, with a projected cost <= 500% at batch 64"
        assert allowed in body["error"]["message"]
        status, body, _ = await register(srv, "acme", root / "acme")  # rank 8 on any modules, but 1,095%
        assert status == 400 and "+1095.4% decode cost" in body["error"]["message"]
    await narrow.close()


async def test_a_narrower_envelope_after_a_restart_refuses_what_it_no_longer_shares(root, tmp_path):
    state = tmp_path / "state"
    first = engine_at(state, root)
    async with running_server(first) as srv:
        assert (await register(srv, "acme", root / "acme"))[0] == 201
        assert (await register(srv, "globex", root / "globex"))[0] == 201
    await first.close()
    again = engine_at(state, root, shared_envelope="attention:16")
    async with running_server(again) as srv:
        status, body, _ = await srv.post(COMP, {"model": "acme", "prompt": "Hi", "max_tokens": 2})
        assert status == 400 and body["error"]["code"] == "adapter_outside_envelope", body
        assert "Allowed on the shared tier: rank<=16 attention-only" in body["error"]["message"]
        assert (await srv.post(COMP, {"model": "globex", "prompt": "Hi", "max_tokens": 2}))[0] == 200
        status, listing, _ = await srv.request("GET", "/v1/adapters/acme/versions", srv.admin())
        assert listing["data"][0]["id"] == "acme@1"  # kept in the registry for an envelope that takes it
    await again.close()


async def test_a_schema_2_registry_gains_its_costs_and_follows_the_reference_batch(root, tmp_path):
    state = tmp_path / "state"
    first = engine_at(state)
    first.add_adapter("acme", root / "acme")
    await first.close()
    db = sqlite3.connect(state / REGISTRY_FILE)  # back to schema 2: no cost column
    db.executescript("ALTER TABLE versions DROP COLUMN projected_cost_pct; UPDATE meta SET value = '2';")
    db.close()
    migrated = engine_at(state)
    assert stored_costs(state) == {"acme@1": pytest.approx(expected_pct(root / "acme"))}
    assert migrated.admin.catalog.versions("acme")[0].projected_cost_pct == pytest.approx(expected_pct(root / "acme"))
    await migrated.close()
    halved = engine_at(state, cost_reference_batch=32)  # the cost is restated at the new batch
    assert stored_costs(state) == {"acme@1": pytest.approx(expected_pct(root / "acme", batch=32))}
    assert halved.admin.info("acme").cost.projected_cost_pct == pytest.approx(expected_pct(root / "acme", 32))
    await halved.close()

"""Two bases side by side in one server (issue 31 item 2), over real HTTP on 127.0.0.1: each
request runs on the engine of the base its adapter version is bound to, a version bound to a base
not served is a 409 naming its digest, and a migration run while both bases serve moves the id's
requests onto the new base's engine without a restart."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
from base_variants import far_base, near_base
from server_harness import METRICS_KEY, assert_openai_error, make_engine, make_roots, running_server

from lorapage import Engine, EngineConfig
from lorapage.bases.serving import ServedBase, followed, route_base, served_migrations, side_config, utilization_share
from lorapage.memory.sizing import POOL_HEADROOM_BYTES, pages_for_memory
from lorapage.model.loader import model_digest
from lorapage.registry.drift_state import MIGRATED, PASSED, MigrationRow
from lorapage.registry.store import REGISTRY_FILE, Registry
from lorapage.sampling_params import SamplingParams
from lorapage.serve.engine_backend import ENGINES
from lorapage.testing.serve_process import run_serve, start_serve
from lorapage.tiny import DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs

PROMPTS = ["Hello", "How are you?", "Tell me about the weather."]
GREEDY = {"max_tokens": 40, "temperature": 0}
UNSERVED = "ab" * 32  # a base no engine here runs


def test_the_routing_rule():
    a, b = ServedBase("a", "1" * 64), ServedBase("b", "2" * 64)
    served = [a, b]
    assert route_base(served, version_base=b.digest) is b
    assert route_base(served, version_base=UNSERVED) is None  # the caller answers 409
    assert route_base(served, model="b") is b and route_base(served, model="b:x") is a
    assert route_base(served) is a  # unbound, the base model by another name: the primary
    migrations = {"x@1": "x@2"}
    assert followed("x", "x@1", migrations) == "x@2" and followed("x@prod", "x@1", migrations) == "x@2"
    assert followed("x@1", "x@1", migrations) == "x@1"  # a version named explicitly stays where it is
    rows = [  # (id, version, target, state, reason, numbers, notice, job, new version, updated)
        MigrationRow("x", 1, b.digest, MIGRATED, None, None, None, "j", 3, 20.0),
        MigrationRow("x", 1, "3" * 64, MIGRATED, None, None, None, "j", 2, 10.0),  # a base not served
        MigrationRow("y", 1, b.digest, PASSED, None, None, None, "j", None, 5.0),  # passed, not migrated
        MigrationRow("z", 4, a.digest, MIGRATED, None, None, None, "j", 5, 1.0),
    ]
    assert served_migrations(rows, {a.digest, b.digest}) == {"x@1": "x@3", "z@4": "z@5"}
    rows.append(MigrationRow("x", 1, a.digest, MIGRATED, None, None, None, "j", 6, 30.0))
    assert served_migrations(rows, {a.digest, b.digest})["x@1"] == "x@6"  # of two, the latest


def test_bases_on_one_gpu_share_its_utilization():
    """Each pool is sized against every byte in use on the device (pages_for_memory): the engine
    built k-th caps at (k+1)/n of the utilization, less the step memory the earlier engines left
    free. Two like bases on one device get equal pools, and use 0.9 of it together at run time."""
    total, weights, activations = 80 << 30, 8 << 30, 2 << 30
    steps = activations + POOL_HEADROOM_BYTES  # what Engine.step_reserve_bytes holds

    def pool(utilization: float, used: int) -> int:  # bytes, with 1-byte pages
        want = 1 << 40
        return pages_for_memory(
            want, 1, total=total, free=total - used, utilization=utilization, activations=activations
        )

    first = pool(utilization_share(0.9, 2, 0, 0, total), weights)
    second = pool(utilization_share(0.9, 2, 1, steps, total), weights + first + weights)
    assert abs(first - second) <= 1 and first == int(0.45 * total) - weights - steps
    assert abs(2 * (weights + steps) + first + second - int(0.9 * total)) <= 2


@pytest.fixture(scope="module")
def near(tmp_path_factory):
    return near_base(tmp_path_factory.mktemp("bases") / "near")


@pytest.fixture(scope="module")
def far(tmp_path_factory):
    return far_base(tmp_path_factory.mktemp("bases") / "far")


@pytest.fixture
def adapter_root(tmp_path):
    root = tmp_path / "adapters"
    root.mkdir()
    for name in DEMO_MARKERS:
        shutil.copytree(demo_adapter_dirs()[name], root / name)
    return root


async def _reference(base, adapter_dir, prompt: str) -> str:
    """Greedy text of ``adapter_dir`` on a single-base engine of ``base`` (in memory)."""
    engine = Engine(EngineConfig(model=str(base)))
    try:
        engine.add_adapter("ref", adapter_dir, expected_base_digest=model_digest(base))
        out = await engine.run_to_end(prompt, "ref", SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0))
        return out.text
    finally:
        await engine.close()


def _served_on(engine: Engine, key: str) -> bool:
    """Whether ``engine`` computed tokens for adapter version ``key`` (its usage ledger)."""
    return any(adapter == key and use.output_tokens for (_, _, adapter), use in engine.usage_rows())


async def _completion(srv, model: str, tenant: str = "alpha", prompt: str = "Hi"):
    return await srv.post("/v1/completions", {"model": model, "prompt": prompt, **GREEDY}, tenant=tenant)


async def test_two_bases_serve_their_own_adapters_and_migrate_while_both_serve(near, far, adapter_root, tmp_path):
    near_digest = model_digest(near)
    state_dir = tmp_path / "state"
    # Registered before the server starts, by an engine on each base: one adapter trained on the
    # near base (beta's), one on the far base (alpha's), which this server will not run.
    before = Engine(EngineConfig(model=str(far), state_dir=str(state_dir)))
    before.add_adapter("cust-far", adapter_root / "initech", owner="alpha", expected_base_digest=model_digest(far))
    await before.close()
    before = Engine(EngineConfig(model=str(near), state_dir=str(state_dir)))
    before.add_adapter("cust-b", adapter_root / "globex", owner="beta", expected_base_digest=near_digest)
    await before.close()
    registry = Registry(state_dir / REGISTRY_FILE)
    registry.add_version(
        "cust-gone", "alpha", digest="d" * 64, source="file:///nowhere", base_digest=UNSERVED, spec="{}", activate=True
    )
    registry.close()

    primary = make_engine(make_roots(adapter_root), state_dir=str(state_dir))
    side = Engine(side_config(primary.config, str(near)), adapter_roots=make_roots(adapter_root))
    reference_b = await _reference(near, adapter_root / "globex", "Hi")
    async with running_server(primary, bases=[side]) as srv:
        # An adapter bound to the primary base, registered over HTTP while both serve.
        body = {"id": "cust-a", "tenant": "alpha", "source": str(adapter_root / "acme"), "check_prompts": PROMPTS}
        status, got, _ = await srv.post("/v1/adapters", body, headers=srv.admin())
        assert status == 201, got

        # One trained on the side base, registered over HTTP: that base's engine checks and serves it.
        body = {"id": "cust-b2", "tenant": "beta", "source": str(adapter_root / "globex")}
        status, got, _ = await srv.post(
            "/v1/adapters", {**body, "expected_base_digest": f"sha256:{near_digest}"}, headers=srv.admin()
        )
        assert status == 201 and (got["parent"], got["base_digest"], got["version"]) == ("near", near_digest, 1), got
        status, again, _ = await srv.post(
            "/v1/adapters", {**body, "expected_base_digest": near_digest}, headers=srv.admin()
        )
        assert status == 200 and again["version"] == 1, again  # the same content: the same version
        status, got, _ = await srv.post(
            "/v1/adapters", {**body, "id": "cust-x", "expected_base_digest": UNSERVED}, headers=srv.admin()
        )
        assert status == 409 and got["error"]["code"] == "adapter_base_mismatch", got
        status, got, headers = await _completion(srv, "cust-b2", tenant="beta")
        assert status == 200 and got["choices"][0]["text"] == reference_b, got
        assert _served_on(side, "cust-b2@1") and not _served_on(primary, "cust-b2@1")
        # Bound by its metadata: base_model_name_or_path names the side base's directory.
        tagged = adapter_root / "globex-near"
        shutil.copytree(adapter_root / "globex", tagged)
        config = json.loads((tagged / "adapter_config.json").read_text())
        (tagged / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(near)}))
        status, got, _ = await srv.post(
            "/v1/adapters", {"id": "cust-b3", "tenant": "beta", "source": str(tagged)}, headers=srv.admin()
        )
        assert status == 201 and (got["parent"], got["base_digest"]) == ("near", near_digest), got
        # Pins act on the primary base's versions; another base's is a 409 saying so.
        status, got, _ = await srv.request("PUT", "/v1/adapters/cust-b2/pin", srv.admin())
        assert status == 409 and "runs on base 'near'" in got["error"]["message"], got
        assert (await srv.request("PUT", "/v1/adapters/acme/pin", srv.admin()))[0] == 200
        # A delete reaches the side engine: the version is gone there too.
        status, got, _ = await srv.request("DELETE", "/v1/adapters/cust-b2", srv.admin())
        assert status == 200, got
        assert (await _completion(srv, "cust-b2", tenant="beta"))[0] == 404
        assert "cust-b2" not in side.admin.catalog.index.ids()

        # Each adapter on its own base's engine, answering what a single-base engine of that base answers.
        status, got, headers = await _completion(srv, "cust-a")
        assert status == 200 and headers["x-adapter-version"] == "1", got
        assert got["choices"][0]["text"] == DEMO_MARKERS["acme"]
        status, got, headers = await _completion(srv, "cust-b", tenant="beta")
        assert status == 200 and headers["x-adapter-version"] == "1", got
        assert got["choices"][0]["text"] == reference_b
        assert _served_on(primary, "cust-a@1") and not _served_on(side, "cust-a@1")
        assert _served_on(side, "cust-b@1") and not _served_on(primary, "cust-b@1")
        # The base models by name, and a streamed request on the side base.
        status, got, _ = await _completion(srv, "near", tenant="gamma")
        assert status == 200 and got["model"] == "near", got
        status, got, _ = await srv.post(
            "/v1/chat/completions",
            {"model": "near:cust-b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            tenant="beta",
        )
        assert status == 200 and got["model"] == "cust-b", got

        # A version bound to a base no engine here runs: 409, naming its digest and the bases served.
        for name in ("cust-far", "cust-gone"):
            status, got, _ = await _completion(srv, name)
            assert status == 409 and got["error"]["code"] == "adapter_base_mismatch", got
            assert_openai_error(got, 409, "model")
            assert f"sha256:{near_digest}" in got["error"]["message"]
        assert f"sha256:{UNSERVED}" in (await _completion(srv, "cust-gone"))[1]["error"]["message"]

        # /v1/models lists both bases, each adapter under the base it runs on; /metrics has a series per base.
        status, models, _ = await srv.request("GET", "/v1/models", srv.auth("beta"))
        parents = {m["id"]: m.get("parent") for m in models["data"]}
        assert parents["cust-b"] == "near" and parents["initech"] == TINY_BASE_DIR.name, parents
        assert {TINY_BASE_DIR.name, "near"} <= set(parents) and "cust-far" not in parents
        status, text, _ = await srv.request("GET", "/metrics", {"Authorization": f"Bearer {METRICS_KEY}"})
        assert f'lorapage_base_info{{base="near",digest="sha256:{near_digest}"}} 1.0' in text
        assert 'lorapage_base_registered_adapters{base="near"}' in text
        status, got, _ = await srv.request("GET", "/v1/usage", srv.admin())
        assert status == 200 and {"cust-a@1", "cust-b@1", "cust-b2@1"} <= {r["adapter"] for r in got["data"]}, got
        status, got, _ = await srv.request("GET", "/internal/state", srv.admin())
        assert set(got["bases"]) == {TINY_BASE_DIR.name, "near"} and got["bases"]["near"]["registered_adapters"] == 2

        # Validate toward the near base and migrate, while both serve: the id's requests move to the near engine.
        # The check runs on the engine already serving the near base (no directory given, none loaded).
        status, got, _ = await srv.request(
            "POST", f"/v1/bases/{UNSERVED}/validate", srv.admin(), {"adapters": ["cust-a"]}
        )
        assert status == 400 and got["error"]["param"] == "model", got  # a base not served needs its directory
        status, got, _ = await srv.request(
            "POST", f"/v1/bases/{near_digest}/validate", srv.admin(), {"adapters": ["cust-a"]}
        )
        assert status == 202, got
        for _ in range(600):
            status, report, _ = await srv.request("GET", f"/v1/bases/{near_digest}/validate", srv.admin())
            if report["job"]["status"] != "running":
                break
            await asyncio.sleep(0.1)
        assert {r["id"]: r["state"] for r in report["adapters"]} == {"cust-a": "passed"}, report
        checked = f"check-{report['job']['id']}-cust-a@1"
        assert _served_on(side, checked) and checked.partition("@")[0] not in side.admin.catalog.index.ids()
        status, got, _ = await srv.request("POST", f"/v1/bases/{near_digest}/migrate", srv.admin())
        assert status == 200 and got["migrated"] == [{"id": "cust-a", "from_version": 1, "version": 2}], got
        status, got, headers = await _completion(srv, "cust-a")
        assert status == 200 and headers["x-adapter-version"] == "2", got
        assert got["choices"][0]["text"] == await _reference(near, adapter_root / "acme", "Hi")
        assert _served_on(side, "cust-a@2") and not _served_on(primary, "cust-a@2")
        # The old version, named explicitly, still runs on the old base.
        status, got, headers = await _completion(srv, "cust-a@1")
        assert status == 200 and headers["x-adapter-version"] == "1", got
        status, models, _ = await srv.request("GET", "/v1/models", srv.auth("alpha"))
        assert {m["id"]: m.get("parent") for m in models["data"]}["cust-a"] == "near"
        assert srv.app[ENGINES].engines.serving_key("cust-a") == "cust-a@2"
    await side.close()
    await primary.close()


async def test_serve_takes_base_flags(near, tmp_path):
    """``lorapage serve --base DIR``: both bases listed and answered; a bad one is one line naming the flag."""
    with start_serve("--base", str(near), "--state-dir", str(tmp_path / "state"), under=tmp_path) as served:
        assert "base model 'near' beside it" in served.output()
        key = re.search(r"demo tenant key: (\S+)", served.output()).group(1)
        headers = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.get(served.url + "/v1/models", headers=headers) as resp:
                ids = {m["id"] for m in (await resp.json())["data"]}
            assert {TINY_BASE_DIR.name, "near", "acme"} <= ids
            body = {"model": "near", "prompt": "Hi", "max_tokens": 4}
            async with session.post(served.url + "/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200 and (await resp.json())["model"] == "near"
        assert served.stop(30) == 0
    refusals = (["--base", str(tmp_path / "absent")], ["--merge", "acme", "--base", str(near)])
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent commands, both at once
        done_all = list(pool.map(lambda args: run_serve(*args), refusals))
    for done in done_all:
        err = done.stderr
        assert done.returncode == 2 and "--base" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err

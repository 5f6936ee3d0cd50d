"""``lorapage fleet --base``: two bases, one engine deployment each, on a local Ray (one fleet start).

The registry is made before the fleet starts, as an operator's would be: an adapter on the tiny
base whose drift check toward a slightly different base passed (``lorapage base check``) and was
migrated, one trained on that other base, one bound to a base nobody runs. Over real HTTP to the
ingress, each request must be answered by a replica of its version's base's deployment; then a
base upgrade runs through the fleet's own validate and migrate routes while both bases serve.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

ray = pytest.importorskip("ray", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")
serve = pytest.importorskip("ray.serve", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")

from base_variants import near_base  # noqa: E402
from server_harness import ADMIN_KEY, KEYS, TENANTS_TOML, assert_openai_error  # noqa: E402

from lorapage import Engine  # noqa: E402
from lorapage.bases.cli import main as base_cli  # noqa: E402
from lorapage.config import EngineConfig  # noqa: E402
from lorapage.fleet.app import APP_NAME, ENGINE_DEPLOYMENT, build_app  # noqa: E402
from lorapage.fleet.backend import REPLICA_HEADER  # noqa: E402
from lorapage.fleet.config import FleetConfig, base_deployment  # noqa: E402
from lorapage.model.loader import model_digest  # noqa: E402
from lorapage.registry.drift_state import CheckPrompts  # noqa: E402
from lorapage.registry.store import REGISTRY_FILE, Registry  # noqa: E402
from lorapage.sampling_params import SamplingParams  # noqa: E402
from lorapage.tiny import DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = ["Hello", "How are you?", "Tell me about the weather."]
UNSERVED = "ab" * 32


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _deployment_of(replica_id: str) -> str:
    """The deployment a replica belongs to, from its Ray actor's name (``...#DEPLOYMENT#<id>``)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return next(n.split("#")[-2] for n in names if n.endswith(f"#{replica_id}"))


def _registry_before_the_fleet(state_dir: Path, adapters: Path, near: Path) -> None:
    """cust-a on the tiny base, checked toward ``near`` and migrated; cust-b trained on ``near``;
    cust-gone bound to a base no deployment runs."""
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), state_dir=str(state_dir)))
    engine.add_adapter("cust-a", adapters / "acme", owner="alpha")
    engine.admin.catalog.drift_record.set_check_prompts(CheckPrompts("cust-a", tuple(PROMPTS)))
    asyncio.run(engine.close())
    check = ["check", str(TINY_BASE_DIR), str(near), "--lora-modules", f"cust-a={adapters / 'acme'}"]
    assert base_cli([*check, "--max-tokens", "16", "--state-dir", str(state_dir)]) == 0  # passed
    registry = Registry(state_dir / REGISTRY_FILE)
    (passed,) = [r for r in registry.migration_states(target=model_digest(near)) if r.key == "cust-a@1"]
    assert registry.migrate_version(passed, actor="test").version == 2  # what POST .../migrate does
    registry.add_version(
        "cust-gone", "alpha", digest="d" * 64, source="file:///nowhere", base_digest=UNSERVED, spec="{}", activate=True
    )
    registry.close()
    engine = Engine(EngineConfig(model=str(near), state_dir=str(state_dir)))
    engine.add_adapter("cust-b", adapters / "globex", owner="beta", expected_base_digest=model_digest(near))
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    near = near_base(tmp_path_factory.mktemp("bases") / "near")
    state_dir, adapters = tmp_path_factory.mktemp("fleet-state"), tmp_path_factory.mktemp("adapters")
    for name, path in demo_adapter_dirs().items():
        shutil.copytree(path, adapters / name)
    _registry_before_the_fleet(state_dir, adapters, near)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    port = _free_port()
    config = FleetConfig(
        engine=EngineConfig(model=str(TINY_BASE_DIR), device="cpu", max_num_seqs=4),
        tenants_toml=TENANTS_TOML,
        lora_modules=(("acme", str(demo_adapter_dirs()["acme"])),),
        bases=(str(near),),
        replicas=1,
        replica_cpus=0.5,
        ingress_cpus=0.25,
        state_dir=str(state_dir),
        adapter_roots=(str(adapters),),
        sync_period_s=0.5,
        port=port,  # the ingress listens itself (Ray Serve's HTTP proxy is off)
    )
    try:
        serve.start(proxy_location="Disabled")
        serve.run(build_app(config), name=APP_NAME, route_prefix=None)
        yield f"http://127.0.0.1:{port}", near
    finally:
        serve.shutdown()
        ray.shutdown()


async def _call(url: str, method: str, path: str, key: str, body: dict | None = None):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.request(method, url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text), resp.headers
            except ValueError:
                return resp.status, text, resp.headers


async def _reference(base: Path, adapter_dir: Path, prompt: str) -> str:
    engine = Engine(EngineConfig(model=str(base)))
    try:
        engine.add_adapter("ref", adapter_dir, expected_base_digest=model_digest(base))
        return (await engine.run_to_end(prompt, "ref", SamplingParams(max_tokens=40, temperature=0.0))).text
    finally:
        await engine.close()


async def test_each_request_goes_to_its_bases_deployment(fleet):
    url, near = fleet
    side = base_deployment(str(near))
    mirrored = False
    for _ in range(60):  # the replicas mirror the registry within a few heartbeats
        status, got, _ = await _call(url, "GET", "/v1/models", KEYS["beta"])
        if status == 200 and "cust-b" in {m["id"] for m in got["data"]}:
            mirrored = True
            break
        await asyncio.sleep(0.5)
    assert mirrored, got
    parents = {m["id"]: m.get("parent") for m in got["data"]}
    assert parents["cust-b"] == "near" and {TINY_BASE_DIR.name, "near"} <= set(parents), parents

    async def complete(model: str, tenant: str = "alpha"):
        body = {"model": model, "prompt": "Hi", "max_tokens": 40, "temperature": 0}
        status, got, headers = await _call(url, "POST", "/v1/completions", KEYS[tenant], body)
        assert status == 200, got
        return got["choices"][0]["text"], headers.get("x-adapter-version"), _deployment_of(headers[REPLICA_HEADER])

    assert await complete("acme") == (DEMO_MARKERS["acme"], "1", ENGINE_DEPLOYMENT)
    globex_on_near = await _reference(near, demo_adapter_dirs()["globex"], "Hi")
    assert await complete("cust-b", "beta") == (globex_on_near, "1", side)
    # The migrated id follows its migration onto the near base; its old version, named, stays on the tiny one.
    acme_on_near = await _reference(near, demo_adapter_dirs()["acme"], "Hi")
    assert await complete("cust-a") == (acme_on_near, "2", side)
    assert await complete("cust-a@1") == (DEMO_MARKERS["acme"], "1", ENGINE_DEPLOYMENT)
    text, _, deployment = await complete("near", "gamma")
    assert deployment == side

    body = {"model": "cust-gone", "prompt": "Hi", "max_tokens": 4}
    status, got, _ = await _call(url, "POST", "/v1/completions", KEYS["alpha"], body)
    assert status == 409 and got["error"]["code"] == "adapter_base_mismatch", got
    assert_openai_error(got, 409, "model")
    assert f"sha256:{UNSERVED}" in got["error"]["message"] and f"sha256:{model_digest(near)}" in got["error"]["message"]

    # Usage is asked of every replica, each through its own deployment.
    status, got, _ = await _call(url, "GET", "/v1/usage", ADMIN_KEY)
    assert status == 200, got
    adapters = {row["adapter"] for row in got["data"]}
    assert {"cust-b@1", "cust-a@2", "cust-a@1"} <= adapters, adapters


async def test_validate_and_migrate_while_both_bases_serve(fleet):
    """``lorapage serve``'s base-upgrade routes in the fleet: the drift check runs its halves on the
    two deployments, the migration lands in the fleet's registry, and the id's requests move to the
    new base's deployment at once; its old version, named, stays on the old one."""
    url, near = fleet
    digest, side = model_digest(near), base_deployment(str(near))
    status, got, _ = await _call(url, "PUT", "/v1/adapters/acme/check_prompts", ADMIN_KEY, {"prompts": PROMPTS})
    assert status == 200 and got["prompts"] == PROMPTS, got
    status, got, _ = await _call(url, "POST", f"/v1/bases/{UNSERVED}/validate", ADMIN_KEY, {"adapters": ["acme"]})
    assert status == 400 and got["error"]["param"] == "digest", got  # a base the fleet does not run
    status, got, _ = await _call(url, "POST", f"/v1/bases/{digest}/validate", ADMIN_KEY, {"adapters": ["acme"]})
    assert status == 202 and got["adapters"] == ["acme@1"], got
    for _ in range(600):
        status, report, _ = await _call(url, "GET", f"/v1/bases/{digest}/validate", ADMIN_KEY)
        if report["job"]["status"] != "running":
            break
        await asyncio.sleep(0.1)
    assert report["job"]["status"] == "done" and report["running_base"] == f"sha256:{model_digest(TINY_BASE_DIR)}"
    assert report["job"]["model"] == str(near)  # the side base's deployment checked on, nothing loaded
    (row,) = [r for r in report["adapters"] if r["id"] == "acme"]
    assert row["state"] == "passed" and row["numbers"]["prompts"] == len(PROMPTS), report
    status, got, _ = await _call(url, "POST", f"/v1/bases/{digest}/migrate", ADMIN_KEY, {"adapters": ["acme"]})
    assert status == 200 and got["migrated"] == [{"id": "acme", "from_version": 1, "version": 2}], got

    async def complete(model: str):
        body = {"model": model, "prompt": "Hi", "max_tokens": 40, "temperature": 0}
        status, got, headers = await _call(url, "POST", "/v1/completions", KEYS["alpha"], body)
        assert status == 200, got
        return got["choices"][0]["text"], headers.get("x-adapter-version"), _deployment_of(headers[REPLICA_HEADER])

    acme_on_near = await _reference(near, demo_adapter_dirs()["acme"], "Hi")
    assert await complete("acme") == (acme_on_near, "2", side)
    assert await complete("acme@1") == (DEMO_MARKERS["acme"], "1", ENGINE_DEPLOYMENT)
    status, got, _ = await _call(url, "GET", "/v1/audit?action=migrate&adapter=acme", ADMIN_KEY)
    assert status == 200 and len(got["data"]) == 1, got

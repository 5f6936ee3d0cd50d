"""The fleet's dedicated tier on a local Ray: an adapter promoted to a merged deployment of its
own (a second Serve application the ingress starts), checked, served there with the tokens it had
on the shared pool, then demoted back; the refusals as OpenAI error JSON; a promotion whose merge
fails leaves the adapter on the shared pool and says why.

One fleet start (one engine replica, the tiny model); real HTTP to Ray Serve's proxy on 127.0.0.1.
The fleet and its client are ``test_fleet_ray``'s.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

ray = pytest.importorskip("ray", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")
serve = pytest.importorskip("ray.serve", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")

from server_harness import ADMIN_KEY, BASE, TENANTS_TOML, assert_openai_error  # noqa: E402
from test_fleet_ray import Fleet, _free_port, completion, engine_replica_ids  # noqa: E402

from lorapage.config import EngineConfig  # noqa: E402
from lorapage.fleet.app import APP_NAME, build_app  # noqa: E402
from lorapage.fleet.backend import REPLICA_HEADER  # noqa: E402
from lorapage.fleet.config import MERGED_APP_PREFIX, FleetConfig  # noqa: E402
from lorapage.tenancy.tenants import key_id  # noqa: E402
from lorapage.tiny import DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SHARED_TIERS = {"cold", "warm", "hot"}  # judged from the fleet's traffic table while not merged
START_S = 180.0  # a merged deployment's start on the shared 2-core machine, at most (placing, merging, checking)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    state_dir, root = tmp_path_factory.mktemp("fleet-state"), tmp_path_factory.mktemp("adapter-root")
    for name, path in demo_adapter_dirs().items():
        shutil.copytree(path, root / name)
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
    )
    port = _free_port()
    config = FleetConfig(
        # The design's envelope: initech (rank 16 on every module) is outside it, tier dedicated.
        # Adapter requests on the shared pool may ask for at most 64 tokens.
        engine=EngineConfig(
            model=str(TINY_BASE_DIR),
            device="cpu",
            max_num_seqs=4,
            shared_envelope="attention:16,all:8",
            max_adapter_tokens=64,
        ),
        tenants_toml=TENANTS_TOML,
        lora_modules=(("acme", str(demo_adapter_dirs()["acme"])),),
        replicas=1,
        replica_cpus=0.5,  # the ingress 0.25 + one engine replica + one merged replica = 1.25 of 2
        ingress_cpus=0.25,
        state_dir=str(state_dir),
        adapter_roots=(str(root),),
        sync_period_s=0.5,
        port=port,  # the ingress listens itself (Ray Serve's HTTP proxy is off)
    )
    try:
        serve.start(proxy_location="Disabled")
        serve.run(build_app(config), name=APP_NAME, route_prefix=None)
        yield Fleet(f"http://127.0.0.1:{port}", str(state_dir), str(root), Path(state_dir) / "unused.jsonl")
    finally:
        serve.shutdown()
        ray.shutdown()


async def promotion_state(fleet: Fleet, adapter_id: str, *, until: set[str]) -> dict:
    """GET the adapter until its dedicated deployment reaches a state in ``until``."""
    deadline = time.monotonic() + START_S
    while True:
        status, body, _ = await fleet.call("GET", f"/v1/adapters/{adapter_id}")
        assert status == 200, body
        if (body["dedicated"] or {}).get("state") in until or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.5)


async def acme_requests(fleet) -> int:
    """alpha's requests on acme@1 in the fleet's usage (every replica's ledger, the dedicated ones'
    too; the merge check's own requests are under the default tenant)."""
    status, usage, _ = await fleet.call("GET", "/v1/usage?adapter=acme")
    assert status == 200, usage
    return sum(row["requests"] for row in usage["data"] if (row["tenant"], row["adapter"]) == ("alpha", "acme@1"))


async def test_promote_serves_the_same_tokens_merged_then_demote_returns_to_the_pool(fleet):
    shared = set(engine_replica_ids())
    body = completion("acme")
    status, before, headers = await fleet.post("/v1/completions", body)
    assert status == 200 and headers[REPLICA_HEADER] in shared
    assert before["choices"][0]["text"] == DEMO_MARKERS["acme"]
    status, err, _ = await fleet.post("/v1/completions", completion("acme", max_tokens=100))
    assert status == 400 and err["error"]["code"] == "adapter_tokens_over_shared_limit"
    assert "POST /v1/adapters/acme/promote" in err["error"]["message"]

    served_before = await acme_requests(fleet)
    status, got, _ = await fleet.call("POST", "/v1/adapters/acme/promote")
    assert status == 202, got
    assert got["dedicated"]["state"] == "starting" and got["dedicated"]["version"] == 1
    assert got["traffic_tier"] in SHARED_TIERS  # not merged until its check has passed
    status, err, _ = await fleet.call("POST", "/v1/adapters/acme/promote")  # twice
    assert status == 409
    assert_openai_error(err, 409, param="id")
    status, err, _ = await fleet.call("POST", "/v1/adapters/acme/demote")  # not serving yet
    assert status == 409

    got = await promotion_state(fleet, "acme", until={"merged", "failed"})
    dedicated = got["dedicated"]
    assert dedicated["state"] == "merged", dedicated
    assert got["traffic_tier"] == "merged"
    assert dedicated["check"]["passed"] and dedicated["check"]["mismatched_prompts"] == 0
    assert dedicated["check"]["prompts"] >= 8 and dedicated["deployment"] == MERGED_APP_PREFIX + "acme"
    assert MERGED_APP_PREFIX + "acme" in serve.status().applications
    (merged_replica,) = dedicated["replicas"]
    assert merged_replica not in shared

    # Served by the merged deployment now, with the greedy tokens the shared pool gave, whole and streamed.
    status, after, headers = await fleet.post("/v1/completions", body)
    assert status == 200 and headers[REPLICA_HEADER] == merged_replica
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert headers["x-adapter-id"] == "acme" and headers["x-adapter-version"] == "1"
    headers, events = await fleet.stream(body)
    assert headers[REPLICA_HEADER] == merged_replica
    assert "".join(c["text"] for e in events for c in e["choices"]) == before["choices"][0]["text"]
    status, _, headers = await fleet.post("/v1/completions", completion("acme", max_tokens=100))
    assert status == 200 and headers[REPLICA_HEADER] == merged_replica  # no shared-pool bound on its tier
    status, base, headers = await fleet.post("/v1/completions", completion(BASE))
    assert status == 200 and headers[REPLICA_HEADER] in shared  # the base stays on the shared pool
    assert await acme_requests(fleet) == served_before + 3  # the merged replica's ledger is in /v1/usage
    status, state, _ = await fleet.call("GET", "/internal/state")
    assert state["ingress"]["dedicated"]["acme"]["state"] == "merged"
    status, err, _ = await fleet.call("DELETE", "/v1/adapters/acme")  # promoted: demote first
    assert status == 409 and "demote" in err["error"]["message"]

    status, got, _ = await fleet.call("POST", "/v1/adapters/acme/demote")
    assert status == 200, got
    assert got["dedicated"] is None and got["traffic_tier"] in SHARED_TIERS
    assert MERGED_APP_PREFIX + "acme" not in serve.status().applications
    status, again, headers = await fleet.post("/v1/completions", body)
    assert status == 200 and headers[REPLICA_HEADER] in shared
    assert again["choices"][0]["text"] == before["choices"][0]["text"]
    status, err, _ = await fleet.call("POST", "/v1/adapters/acme/demote")  # not promoted any more
    assert status == 409
    assert_openai_error(err, 409, param="id")

    status, audit, _ = await fleet.call("GET", "/v1/audit?adapter=acme")
    rows = {r["action"]: r for r in audit["data"] if r["action"] in ("promote", "demote")}
    assert rows["promote"]["outcome"] == "ok" and rows["demote"]["outcome"] == "ok"
    assert rows["promote"]["actor"] == rows["demote"]["actor"] == key_id(ADMIN_KEY)
    assert rows["promote"]["after"]["check"]["passed"] is True


async def test_an_adapter_outside_the_envelope_is_served_once_promoted(fleet):
    source = Path(fleet.adapter_root) / "initech"
    status, got, _ = await fleet.call("POST", "/v1/adapters", {"id": "heavy", "tenant": "alpha", "source": str(source)})
    assert status == 201, got
    assert got["serving_tier"] == "dedicated" and got["rank"] == 16 and got["dedicated"] is None
    status, err, _ = await fleet.post("/v1/completions", completion("heavy"))  # never shared silently
    assert status == 400
    assert_openai_error(err, 400)
    assert err["error"]["code"] == "adapter_outside_envelope"
    assert "POST /v1/adapters/heavy/promote" in err["error"]["message"]

    status, got, _ = await fleet.call("POST", "/v1/adapters/heavy/promote")
    assert status == 202, got
    got = await promotion_state(fleet, "heavy", until={"merged", "failed"})
    assert got["dedicated"]["state"] == "merged" and got["traffic_tier"] == "merged", got["dedicated"]
    status, body, headers = await fleet.post("/v1/completions", completion("heavy"))
    assert status == 200 and headers[REPLICA_HEADER] == got["dedicated"]["replicas"][0]
    assert body["choices"][0]["text"] == DEMO_MARKERS["initech"]  # what its LoRA path gives on one server

    status, got, _ = await fleet.call("POST", "/v1/adapters/heavy/demote")
    assert status == 200 and got["serving_tier"] == "dedicated"
    status, err, _ = await fleet.post("/v1/completions", completion("heavy"))
    assert status == 400 and err["error"]["code"] == "adapter_outside_envelope"


async def test_refusals_are_openai_errors(fleet):
    for path in ("/v1/adapters/no-such/promote", "/v1/adapters/no-such/demote"):
        status, err, _ = await fleet.call("POST", path)
        assert status == 404, err
        assert_openai_error(err, 404)
    status, err, _ = await fleet.call("GET", "/v1/adapters/acme/promote")
    assert status == 405
    status, err, _ = await fleet.call("POST", "/v1/adapters/acme/promote", key=None)
    assert status == 401
    assert_openai_error(err, 401)


async def test_a_failed_merge_leaves_the_adapter_on_the_pool_and_says_why(fleet):
    source = Path(fleet.adapter_root) / "globex"
    status, got, _ = await fleet.call("POST", "/v1/adapters", {"id": "flaky", "tenant": "alpha", "source": str(source)})
    assert status == 201, got
    status, served, _ = await fleet.post("/v1/completions", completion("flaky", max_tokens=8))
    assert status == 200  # resident on the shared pool now
    # Its files change after registration: the merged replica's engine reads them and refuses them.
    weights = "adapter_model.safetensors"
    shutil.copyfile(Path(fleet.adapter_root) / "acme" / weights, source / weights)
    status, got, _ = await fleet.call("POST", "/v1/adapters/flaky/promote")
    assert status == 202
    got = await promotion_state(fleet, "flaky", until={"failed", "merged"})
    dedicated = got["dedicated"]
    assert dedicated["state"] == "failed", dedicated
    assert dedicated["reason"].startswith("the merge failed: adapter flaky@1 could not be loaded"), dedicated
    assert got["traffic_tier"] in SHARED_TIERS and MERGED_APP_PREFIX + "flaky" not in serve.status().applications
    status, again, headers = await fleet.post("/v1/completions", completion("flaky", max_tokens=8))
    assert status == 200 and headers[REPLICA_HEADER] in engine_replica_ids()  # still the shared pool's
    assert again["choices"][0]["text"] == served["choices"][0]["text"]
    status, audit, _ = await fleet.call("GET", "/v1/audit?adapter=flaky&action=promote")
    (row,) = audit["data"]
    assert row["outcome"] == f"failed: {dedicated['reason']}"


async def test_a_restarted_ingress_adopts_the_running_merged_deployment(fleet):
    status, got, _ = await fleet.call("POST", "/v1/adapters/acme/promote")
    assert status == 202, got
    got = await promotion_state(fleet, "acme", until={"merged", "failed"})
    assert got["dedicated"]["state"] == "merged", got["dedicated"]
    (merged_replica,) = got["dedicated"]["replicas"]

    # Ray restarts a killed ingress; its first heartbeat adopts the application still running.
    ingress = next(n for n in ray.util.list_named_actors(all_namespaces=True) if "#FleetIngress#" in n["name"])
    ray.kill(ray.get_actor(ingress["name"], namespace=ingress["namespace"]), no_restart=False)
    deadline = time.monotonic() + 90
    while True:
        try:
            status, got, _ = await fleet.call("GET", "/v1/adapters/acme")
        except aiohttp.ClientError:
            status, got = 0, None
        if status == 200 and (got["dedicated"] or {}).get("state") == "merged" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert got["dedicated"]["state"] == "merged" and got["dedicated"]["actor"] == "adopted", got
    assert got["dedicated"]["replicas"] == [merged_replica] and got["traffic_tier"] == "merged"
    status, body, headers = await fleet.post("/v1/completions", completion("acme"))
    assert status == 200 and headers[REPLICA_HEADER] == merged_replica
    assert body["choices"][0]["text"] == DEMO_MARKERS["acme"]
    status, _, _ = await fleet.call("POST", "/v1/adapters/acme/demote")
    assert status == 200 and MERGED_APP_PREFIX + "acme" not in serve.status().applications

"""``lorapage fleet`` on a local Ray: one ingress and two engine replicas of the tiny model.

Real HTTP to the ingress (``lorapage serve``'s front end, on aiohttp) on a free 127.0.0.1 port.
The engine deployment routes with one rendezvous owner per adapter (``owners=1``) and a batch
capacity of four (``max_num_seqs``), so stickiness and spill are both visible with two replicas.
The admin tests register, deploy, pin and delete adapters through the ingress (a state directory
holds the fleet's registry); the ingress-restart and replica-kill tests run last: they replace an
ingress and a replica.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

ray = pytest.importorskip("ray", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")
serve = pytest.importorskip("ray.serve", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")

from front_end_cases import answers, mismatches  # noqa: E402
from server_harness import (  # noqa: E402
    ADMIN_KEY,
    BASE,
    KEYS,
    METRICS_KEY,
    TENANTS_TOML,
    assert_openai_error,
    expected_text,
    make_engine,
)

from lorapage.config import EngineConfig  # noqa: E402
from lorapage.fleet.app import APP_NAME, ENGINE_DEPLOYMENT, build_app  # noqa: E402
from lorapage.fleet.backend import REPLICA_HEADER  # noqa: E402
from lorapage.fleet.config import FleetConfig  # noqa: E402
from lorapage.fleet.routing import rendezvous_owners  # noqa: E402
from lorapage.model.tokenizer import Tokenizer  # noqa: E402
from lorapage.registry.store import REGISTRY_FILE, Registry  # noqa: E402
from lorapage.sampling_params import SamplingParams  # noqa: E402
from lorapage.tenancy.tenants import hash_key, key_id  # noqa: E402
from lorapage.tiny import DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CAPACITY = 4  # max_num_seqs of each replica: the load at which its adapters spill
HOT_REQUESTS = 12  # an hour, fleet-wide: acme passes it in the stickiness and spill tests, on both replicas
CHAT = [{"role": "user", "content": "Who are you?"}]
# alpha sets SLOs, so the ingress exports its targets and burn rates.
SLO_TENANTS_TOML = TENANTS_TOML.replace(
    "[tenants.alpha]\n", "[tenants.alpha]\nslo_ttft_p95_s = 60.0\nslo_error_rate = 0.01\n"
)


@dataclass
class Fleet:
    url: str
    state_dir: str
    adapter_root: str
    access_log: Path

    async def call(self, method: str, path: str, body: dict | None = None, key: str | None = ADMIN_KEY):
        """(status, parsed JSON or text, headers) of one request, by default with the admin key."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.request(method, self.url + path, json=body, headers=headers) as resp:
                text = await resp.text()
                try:
                    return resp.status, json.loads(text), resp.headers
                except ValueError:
                    return resp.status, text, resp.headers

    async def post(self, path: str, body: dict, tenant: str = "alpha"):
        """(status, parsed JSON, headers)."""
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(self.url + path, json=body, headers=headers) as resp:
                text = await resp.text()
                return resp.status, json.loads(text), resp.headers

    async def stream(self, body: dict, started: asyncio.Event | None = None):
        """(headers, the JSON payloads up to [DONE]) of a streamed completion; ``started`` is set
        once the first token arrives."""
        headers = {"Authorization": f"Bearer {KEYS['alpha']}"}
        events = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(self.url + "/v1/completions", json={**body, "stream": True}, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line:
                        continue
                    if line == "data: [DONE]":
                        return resp.headers, events
                    events.append(json.loads(line.removeprefix("data: ")))
                    if started is not None:
                        started.set()
        raise AssertionError("the stream ended without data: [DONE]")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_replica_ids() -> list[str]:
    """The live engine replicas' ids, from their Ray actor names (``...#EngineReplica#<id>``)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n.rsplit("#", 1)[1] for n in names if f"#{ENGINE_DEPLOYMENT}#" in n)


def owner(adapter: str) -> str:
    return rendezvous_owners(adapter, engine_replica_ids(), 1)[0]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    state_dir, root = tmp_path_factory.mktemp("fleet-state"), tmp_path_factory.mktemp("adapter-root")
    access_log = tmp_path_factory.mktemp("logs") / "access.jsonl"
    for name, path in demo_adapter_dirs().items():  # registrable copies of the demo adapters
        shutil.copytree(path, root / name)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},  # two engines share two cores
    )
    port = _free_port()
    config = FleetConfig(
        # The fleet's tiers judged every half second; hot from HOT_REQUESTS an hour (the share rule off).
        engine=EngineConfig(
            model=str(TINY_BASE_DIR),
            device="cpu",
            max_num_seqs=CAPACITY,
            tier_interval_s=0.5,
            tier_hot_requests_per_hour=HOT_REQUESTS,
            tier_hot_share=1.0,
        ),
        tenants_toml=SLO_TENANTS_TOML,
        access_log=str(access_log),
        lora_modules=tuple((name, str(path)) for name, path in demo_adapter_dirs().items()),
        replicas=2,
        replica_cpus=0.5,
        ingress_cpus=0.25,
        owners=1,
        routing_stats_period_s=0.5,
        state_dir=str(state_dir),
        adapter_roots=(str(root),),
        sync_period_s=0.5,
        port=port,  # the ingress listens itself (Ray Serve's HTTP proxy is off)
    )
    try:
        serve.start(proxy_location="Disabled")
        serve.run(build_app(config), name=APP_NAME, route_prefix=None)
        yield Fleet(f"http://127.0.0.1:{port}", str(state_dir), str(root), access_log)
    finally:
        serve.shutdown()
        ray.shutdown()


def completion(model: str, **kw) -> dict:
    return {"model": model, "prompt": "Hello there", "max_tokens": 48, "temperature": 0, **kw}


async def test_outputs_equal_a_single_engines(fleet):
    engine = make_engine(device="cpu")
    try:
        ids = engine.tokenizer.encode("Hello there", add_special_tokens=True)
        for model, adapter in ((BASE, None), ("acme", "acme"), (f"{BASE}:globex", "globex"), ("acme@1", "acme")):
            for sampling in (SamplingParams(max_tokens=48, temperature=0), SamplingParams(max_tokens=24, seed=7)):
                async for last in engine.generate(ids, adapter, sampling):
                    pass
                status, body, headers = await fleet.post(
                    "/v1/completions", completion(model, max_tokens=sampling.max_tokens,
                                                  temperature=sampling.temperature, seed=sampling.seed),
                )  # fmt: skip
                assert status == 200, body
                assert body["choices"][0]["text"] == last.text
                assert headers["x-adapter-id"] == (adapter or "none")
                assert headers.get("x-adapter-version") == (adapter and "1")  # the version that served
        status, body, _ = await fleet.post(
            "/v1/chat/completions", {"model": "acme", "messages": CHAT, "temperature": 0}
        )
        assert status == 200 and body["choices"][0]["message"]["content"] == expected_text("acme")
    finally:
        await engine.close()


async def test_streaming_equals_whole(fleet):
    status, whole, _ = await fleet.post("/v1/completions", completion("globex"))
    assert status == 200
    headers, events = await fleet.stream(completion("globex", stream_options={"include_usage": True}))
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["choices"][0]["text"]
    assert events[-1]["usage"] == whole["usage"]
    assert headers["x-adapter-id"] == "globex" and headers["x-adapter-tier"] in ("gpu", "ram", "disk")
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers.getall("x-request-id") == [events[0]["id"]]  # one id, the body's (as lorapage serve answers)


async def test_the_api_fields_work_through_the_fleet(fleet):
    """The cases of test_server_api_fields that the fleet's front end serves the same way:
    structured output, required tools, n and batched prompts, echo."""
    schema = {"type": "object", "properties": {"d": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["d"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    status, body, _ = await fleet.post(
        "/v1/chat/completions", {"model": "acme", "messages": CHAT, "response_format": fmt, "max_tokens": 40}
    )
    assert status == 200, body
    assert 1 <= json.loads(body["choices"][0]["message"]["content"])["d"] <= 9
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    status, body, _ = await fleet.post(
        "/v1/chat/completions",
        {"model": "globex", "messages": CHAT, "tools": [tool], "tool_choice": "required",
         "parallel_tool_calls": False, "max_tokens": 60},
    )  # fmt: skip
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls", body
    assert json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])["d"] >= 1
    status, body, _ = await fleet.post(
        "/v1/completions", completion("acme", prompt=["Hello", "Hi"], n=2, max_tokens=4, echo=True, logprobs=1)
    )
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3], body
    assert body["choices"][2]["text"].startswith("Hi") and body["choices"][0]["logprobs"]["token_logprobs"][0] is None


async def test_the_shared_http_cases(fleet):
    """The table tests/server/test_front_end_cases.py runs against ``lorapage serve``."""
    assert mismatches(await answers(fleet.url)) == {}


async def test_requests_for_one_adapter_stick_to_its_owner(fleet):
    for adapter in ("acme", "initech"):
        tenant = "beta" if adapter == "initech" else "alpha"
        served = set()
        for _ in range(4):
            status, body, headers = await fleet.post("/v1/completions", completion(adapter), tenant=tenant)
            assert status == 200, body
            served.add(headers[REPLICA_HEADER])
        assert served == {owner(adapter)}


async def test_saturated_owner_spills_to_the_other_replica(fleet):
    # Sampled at a high temperature, the tiny model rarely meets EOS: each request runs its 96 tokens.
    bodies = [completion("acme", temperature=2.0, seed=i, max_tokens=96) for i in range(3 * CAPACITY)]
    # Sent 50 ms apart, as traffic arrives: requests routed in the same instant all see the load
    # Ray counted before any of them was sent (its queue-length cache counts a request once sent).
    posts = []
    for body in bodies:
        posts.append(asyncio.ensure_future(fleet.post("/v1/completions", body)))
        await asyncio.sleep(0.05)
    answers = await asyncio.gather(*posts)
    assert all(status == 200 for status, _, _ in answers), answers
    served = Counter(headers[REPLICA_HEADER] for _, _, headers in answers)
    assert set(served) == set(engine_replica_ids()), served
    assert served[owner("acme")] >= CAPACITY, served


async def test_tenant_isolation_and_fleet_wide_quota(fleet):
    status, body, _ = await fleet.post("/v1/completions", completion("initech"))  # beta's
    assert status == 404
    assert_openai_error(body, 404, param="model")
    status, missing, _ = await fleet.post("/v1/completions", completion("no-such-adapter"))
    assert (
        status == 404 and missing["error"]["message"].replace("no-such-adapter", "initech") == body["error"]["message"]
    )
    async with aiohttp.ClientSession() as s:
        async with s.get(fleet.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['alpha']}"}) as resp:
            assert {m["id"] for m in (await resp.json())["data"]} == {BASE, "acme", "globex"}
        async with s.post(fleet.url + "/v1/completions", json=completion(BASE)) as resp:
            assert resp.status == 401
            assert_openai_error(await resp.json(), 401)
    # gamma may send two requests a minute, whichever replica serves them.
    got = [await fleet.post("/v1/completions", completion(BASE), tenant="gamma") for _ in range(3)]
    assert [status for status, _, _ in got] == [200, 200, 429]
    assert_openai_error(got[2][1], 429)
    assert int(got[2][2]["Retry-After"]) >= 1


async def test_two_tenants_sending_one_x_request_id_at_once_both_succeed(fleet):
    """A client's x-request-id was the engine's request id, so a tenant that predicted another's
    id could send it first and have the other's request refused (400: already in flight); now it
    is neither the engine's id nor the one answered. Four
    overlapping streams on two replicas: at least two of them run on one engine at once."""
    client_id = "predictable-id-1"

    async def send(tenant: str, seed: int, started: asyncio.Event) -> tuple[int, str, str]:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}", "x-request-id": client_id}
        # Sampled at a high temperature, the tiny model rarely meets EOS: each stream runs long.
        body = completion(BASE, temperature=2.0, seed=seed, max_tokens=400, stream=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(fleet.url + "/v1/completions", json=body, headers=headers) as resp:
                first_id = ""
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("data: {") and not first_id:
                        first_id = json.loads(line.removeprefix("data: ")).get("id", "")
                        started.set()
                started.set()  # refused: nothing streamed
                return resp.status, resp.headers.get("x-request-id", ""), first_id

    tasks = []
    for seed, tenant in enumerate(("alpha", "beta", "alpha", "beta")):
        started = asyncio.Event()
        tasks.append(asyncio.ensure_future(send(tenant, seed, started)))
        await started.wait()  # under way before the next is sent
    answers = await asyncio.gather(*tasks)
    assert [status for status, _, _ in answers] == [200] * 4, answers
    # The front end makes its own ids (as lorapage serve does): one per request, the body's and the header's.
    assert all(echoed == body_id != client_id for _, echoed, body_id in answers), answers
    assert len({echoed for _, echoed, _ in answers}) == 4


async def eventually(check, timeout_s: float = 15.0):
    """``check()``'s value once it is truthy (heartbeats carry changes to every replica)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (got := await check()):
        assert asyncio.get_running_loop().time() < deadline, "not within the timeout"
        await asyncio.sleep(0.25)
    return got


async def test_admin_registers_deploys_and_deletes_fleet_wide(fleet):
    source = f"{fleet.adapter_root}/acme"
    # Sampling check prompts from traffic is refused before anything is stored (the ingress samples none).
    sampled = {"id": "newco", "tenant": "alpha", "source": source, "sample_check_prompts": True}
    status, err, _ = await fleet.call("POST", "/v1/adapters", sampled)
    assert status == 400 and err["error"]["param"] == "sample_check_prompts", err
    status, _, _ = await fleet.call("GET", "/v1/adapters/newco")
    assert status == 404
    status, body, _ = await fleet.call("POST", "/v1/adapters", {"id": "newco", "tenant": "alpha", "source": source})
    assert status == 201, body
    assert body["version"] == 1 and body["owner"] == "alpha" and body["current"] == 1
    # Costed by the replica that prepared it (docs/capacity.md), stored with the version.
    assert body["serving_tier"] == "shared" and body["cost"]["reference_batch"] == 64
    assert body["projected_cost_pct"] == body["cost"]["decode_bytes_pct"] > 0
    # Servable at once, on whichever replica the router picks, with the registered weights.
    status, got, headers = await fleet.post("/v1/completions", completion("newco"))
    assert status == 200 and got["choices"][0]["text"] == DEMO_MARKERS["acme"]
    assert headers["x-adapter-version"] == "1"
    status, _, _ = await fleet.post("/v1/completions", completion("newco"), tenant="beta")  # not beta's
    assert status == 404
    # Same content again: the same version (200); other content: version 2, deployed later.
    status, again, _ = await fleet.call("POST", "/v1/adapters", {"id": "newco", "tenant": "alpha", "source": source})
    assert status == 200 and again["version"] == 1
    body2 = {"id": "newco", "tenant": "alpha", "source": f"{fleet.adapter_root}/globex", "activate": False}
    status, v2, _ = await fleet.call("POST", "/v1/adapters", body2)
    assert status == 201 and v2["version"] == 2 and v2["current"] == 1
    status, got, _ = await fleet.post("/v1/completions", completion("newco"))
    assert got["choices"][0]["text"] == DEMO_MARKERS["acme"]
    status, _, _ = await fleet.call("PUT", "/v1/adapters/newco/current", {"version": 2})
    assert status == 200
    for model, text, version in (("newco", "globex", "2"), ("newco@1", "acme", "1")):
        status, got, headers = await fleet.post("/v1/completions", completion(model))
        assert status == 200 and got["choices"][0]["text"] == DEMO_MARKERS[text]
        assert headers["x-adapter-version"] == version
    status, versions, _ = await fleet.call("GET", "/v1/adapters/newco/versions")
    assert [(v["version"], v["current"]) for v in versions["data"]] == [(1, False), (2, True)]
    # Committed to the fleet's registry file before it was answered.
    stored = Registry(f"{fleet.state_dir}/{REGISTRY_FILE}")
    listed = [(v["id"], v["digest"], v["projected_cost_pct"]) for v in versions["data"]]
    assert [(r.key, r.digest, r.projected_cost_pct) for r in stored.versions() if r.adapter_id == "newco"] == listed
    assert listed[0][2] == body["projected_cost_pct"]
    stored.close()
    status, err, _ = await fleet.call("DELETE", "/v1/adapters/newco@2")  # the current of two
    assert status == 409
    assert_openai_error(err, 409, param="id")
    status, _, _ = await fleet.call("POST", "/v1/adapters", {"id": "newco", "tenant": "beta", "source": source})
    assert status == 409  # alpha's id
    status, gone, _ = await fleet.call("DELETE", "/v1/adapters/newco")
    assert status == 200 and gone["deleted"] is True
    status, err, _ = await fleet.post("/v1/completions", completion("newco"))
    assert status == 404
    status, err, _ = await fleet.call("POST", "/v1/adapters", {"id": "x", "tenant": "alpha", "source": "/etc"})
    assert status in (400, 403) and err["error"]["param"] == "source"
    status, err, _ = await fleet.call("GET", "/v1/adapters", key=KEYS["alpha"])  # a tenant key
    assert status == 403
    assert_openai_error(err, 403)


async def test_rollback_channels_and_history_as_one_server_has_them(fleet):
    """The version routes of ``lorapage serve`` through the ingress: a channel deployed on its own
    and served as ``id@channel``, a rollback in one call (again: one deploy further back), the
    alias history with its previous versions (the owner's key reads its own, without actors), and
    the id's check prompts."""
    root = fleet.adapter_root
    for source, activate in (("acme", True), ("globex", False), ("initech", False)):
        body = {"id": "chan", "tenant": "alpha", "source": f"{root}/{source}", "activate": activate}
        status, got, _ = await fleet.call("POST", "/v1/adapters", body)
        assert status == 201, got
    for version in (2, 3):
        status, got, _ = await fleet.call("PUT", "/v1/adapters/chan/current", {"version": version})
        assert status == 200, got
    status, got, _ = await fleet.call("PUT", "/v1/adapters/chan/channels/prod", {"version": 1})
    assert status == 200 and got["version"] == 1, got
    for model, marker in (("chan", "initech"), ("chan@prod", "acme")):
        status, got, _ = await fleet.post("/v1/completions", completion(model))
        assert status == 200 and got["choices"][0]["text"] == DEMO_MARKERS[marker], (model, got)
    status, err, _ = await fleet.call("DELETE", "/v1/adapters/chan@1")  # prod serves it
    assert status == 409 and "channel 'prod'" in err["error"]["message"]
    status, got, _ = await fleet.call("POST", "/v1/adapters/chan/rollback")
    assert status == 200 and got["version"] == 2 and got["current"] == 2, got
    status, got, _ = await fleet.call("POST", "/v1/adapters/chan/rollback")  # one deploy further back
    assert status == 200 and got["version"] == 1, got
    status, err, _ = await fleet.call("POST", "/v1/adapters/chan/rollback", {"channel": "prod"})
    assert status == 409  # prod never moved: nothing to roll back to
    assert_openai_error(err, 409, param="version")
    status, history, _ = await fleet.call("GET", "/v1/adapters/chan/history")
    assert status == 200 and history["current"] == 1 and history["channels"] == {"prod": 1}
    moves = [(m["alias"], m["from_version"], m["to_version"], m["action"]) for m in history["data"]]
    assert moves[:4] == [
        ("chan", 2, 1, "rollback"),
        ("chan", 3, 2, "rollback"),
        ("chan@prod", None, 1, "deploy"),
        ("chan", 2, 3, "deploy"),
    ]
    assert all(m["actor"] for m in history["data"])
    status, own, _ = await fleet.call("GET", "/v1/adapters/chan/history", key=KEYS["alpha"])
    assert status == 200 and own["data"] and all("actor" not in m for m in own["data"])
    status, err, _ = await fleet.call("GET", "/v1/adapters/chan/history", key=KEYS["beta"])
    assert status == 404  # not beta's: as if it did not exist
    # Its check prompts (what a promotion's equivalence check runs beside the built-in ones): the
    # owner sets and reads them; the fleet keeps no traffic sample.
    status, got, _ = await fleet.call("PUT", "/v1/adapters/chan/check_prompts", {"prompts": ["Hi"]}, key=KEYS["alpha"])
    assert status == 200 and got["prompts"] == ["Hi"] and got["sample"] is False, got
    status, got, _ = await fleet.call("GET", "/v1/adapters/chan/check_prompts")
    assert status == 200 and got["prompts"] == ["Hi"]
    status, err, _ = await fleet.call("PUT", "/v1/adapters/chan/check_prompts", {"sample": True})
    assert status == 400 and err["error"]["param"] == "sample"
    status, err, _ = await fleet.call("GET", "/v1/adapters/chan/check_prompts", key=KEYS["beta"])
    assert status == 404
    status, got, _ = await fleet.call("DELETE", "/v1/adapters/chan/channels/prod")
    assert status == 200 and got["deleted"] is True
    status, err, _ = await fleet.post("/v1/completions", completion("chan@prod"))
    assert status == 404
    status, err, _ = await fleet.call("PUT", "/v1/adapters/chan/channels/9x", {"version": 1})
    assert status == 400 and err["error"]["param"] == "channel"
    status, _, _ = await fleet.call("DELETE", "/v1/adapters/chan")
    assert status == 200


async def test_fleet_registration_binds_the_trained_on_base_as_one_server_does(fleet):
    """The owner replica applies the rule: an adapter that names no base is refused with the fix,
    one bound to another base with both digests and the migration route; nothing is committed."""
    from lorapage.model.loader import model_digest

    running = model_digest(TINY_BASE_DIR)
    unbound = Path(fleet.adapter_root) / "unbound-copy"
    shutil.copytree(demo_adapter_dirs()["initech"], unbound)
    cfg = json.loads((unbound / "adapter_config.json").read_text())
    del cfg["base_model_name_or_path"]
    (unbound / "adapter_config.json").write_text(json.dumps(cfg))
    body = {"id": "unbound-co", "tenant": "beta", "source": str(unbound)}
    status, got, _ = await fleet.call("POST", "/v1/adapters", body)
    assert status == 400 and got["error"]["code"] == "adapter_base_unknown", got
    assert "--base-names" in got["error"]["message"] and "--allow-unbound" in got["error"]["message"]
    other = "0" * 64
    status, got, _ = await fleet.call("POST", "/v1/adapters", {**body, "expected_base_digest": other})
    assert status == 409 and got["error"]["code"] == "adapter_base_mismatch", got
    message = got["error"]["message"]
    assert f"sha256:{other}" in message and f"sha256:{running}" in message
    assert f"POST /v1/bases/{running}/validate" in message and "register it again" not in message
    assert (await fleet.call("GET", "/v1/adapters/unbound-co"))[0] == 404
    status, got, _ = await fleet.call("POST", "/v1/adapters", {**body, "expected_base_digest": running})
    assert status == 201 and got["base_digest"] == running, got


async def test_vllm_routes_and_responses_through_the_ingress(fleet):
    """The routes of test_server_routes.py and test_server_responses.py, a few cases each, as the
    ingress serves them (its own dispatch, the same shared modules)."""
    tokenizer = Tokenizer.from_dir(TINY_BASE_DIR)
    alpha = KEYS["alpha"]
    status, got, _ = await fleet.call("POST", "/tokenize", {"model": "acme", "prompt": "Hello there"}, key=alpha)
    assert status == 200 and got["tokens"] == tokenizer.encode("Hello there") and got["count"] == len(got["tokens"])
    assert (await fleet.call("POST", "/tokenize", {"model": "initech", "prompt": "hi"}, key=alpha))[0] == 404
    status, got, _ = await fleet.call("POST", "/detokenize", {"tokens": got["tokens"]}, key=alpha)
    assert status == 200 and got == {"prompt": "<|startoftext|>Hello there"}
    status, got, _ = await fleet.call("GET", "/tokenizer_info", key=alpha)
    assert status == 200 and got["eos_token"] == "<|endoftext|>" and got["chat_template"] == tokenizer.chat_template
    assert (await fleet.call("GET", "/tokenizer_info", key=None))[0] == 200  # the base's, for lm-eval's probe
    assert (await fleet.call("POST", "/tokenize", {"model": "acme", "prompt": "hi"}, key=None))[0] == 401
    status, got, _ = await fleet.call("GET", "/version", key=None)
    assert status == 200 and set(got) == {"version"}
    assert [(await fleet.call(m, "/ping", key=None))[:2] for m in ("GET", "POST")] == [(200, "")] * 2
    for path, near in (("/v1/adapter", "POST /v1/adapters"), ("/v1/response", "POST /v1/responses")):
        status, got, _ = await fleet.call("POST", path, {})
        assert status == 404 and f"did you mean {near}?" in got["error"]["message"]
    status, got, _ = await fleet.call("GET", "/v1/adapters/acme/version")
    assert status == 404 and "did you mean GET /v1/adapters/{id}/versions?" in got["error"]["message"]

    load = {"lora_name": "vllm-style", "lora_path": f"{fleet.adapter_root}/globex", "tenant": "alpha"}
    assert (await fleet.call("POST", "/v1/load_lora_adapter", load))[:2] == (
        200,
        "Success: LoRA adapter 'vllm-style' added successfully.",
    )
    status, got, _ = await fleet.post("/v1/completions", completion("vllm-style"))
    assert status == 200 and got["choices"][0]["text"] == DEMO_MARKERS["globex"]
    status, got, _ = await fleet.call("POST", "/v1/load_lora_adapter", load)
    assert status == 400 and "has already been loaded" in got["error"]["message"]
    assert (await fleet.call("POST", "/v1/load_lora_adapter", load, key=alpha))[0] == 403
    assert (await fleet.call("POST", "/v1/unload_lora_adapter", {"lora_name": "vllm-style"}))[:2] == (
        200,
        "Success: LoRA adapter 'vllm-style' removed successfully.",
    )
    assert (await fleet.post("/v1/completions", completion("vllm-style")))[0] == 404

    body = {"model": "acme", "input": "Who are you?", "temperature": 0, "max_output_tokens": 64}
    status, whole, headers = await fleet.post("/v1/responses", body)
    assert status == 200 and whole["status"] == "completed" and headers["x-adapter-id"] == "acme"
    assert whole["output"][0]["content"][0]["text"] == expected_text("acme")
    events = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        headers = {"Authorization": f"Bearer {alpha}"}
        async with s.post(fleet.url + "/v1/responses", json={**body, "stream": True}, headers=headers) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == expected_text("acme") and events[-1]["response"]["usage"] == whole["usage"]
    status, got, _ = await fleet.post("/v1/responses", {**body, "store": True})
    assert status == 400
    assert_openai_error(got, 400, param="store")


async def test_pin_unload_metrics_and_state_reach_every_replica(fleet):
    replicas = set(engine_replica_ids())
    status, body, _ = await fleet.call("PUT", "/v1/adapters/globex/pin")
    assert status == 200 and body["pinned"] is True

    async def resident_everywhere():
        status, body, _ = await fleet.call("GET", "/v1/adapters/globex")
        # every replica's pool (a replica may hold it in host RAM first: warm versions are read in)
        return body if set(body["replicas"]) == replicas and set(body["replicas"].values()) == {"gpu"} else None

    body = await eventually(resident_everywhere)
    assert body["tier"] == "gpu"
    status, body, _ = await fleet.call("DELETE", "/v1/adapters/globex/pin")
    assert status == 200 and body["pinned"] is False
    status, body, _ = await fleet.call("POST", "/internal/adapters/globex/unload")
    assert status == 200 and "gpu" not in body["replicas"].values()

    status, _, _ = await fleet.call("GET", "/metrics", key=None)
    assert status == 401
    status, text, headers = await fleet.call("GET", "/metrics", key=METRICS_KEY)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert "lorapage_fleet_replicas 2.0" in text
    for rid in replicas:  # every replica's engine series, labelled with it
        assert f'lorapage_engine_queue_depth{{replica="{rid}"}}' in text
    assert 'lorapage_time_to_first_token_seconds_count{adapter_tier="' in text  # seen at the ingress
    assert 'lorapage_requests_total{route="/v1/completions",status="200"}' in text
    assert 'lorapage_fleet_rejected_requests_total{reason="rpm",tenant="gamma"} 1.0' in text  # the quota test's 429
    status, state, _ = await fleet.call("GET", "/internal/state")
    assert status == 200 and set(state["replicas"]) == replicas
    assert state["ingress"]["registry_generation"] >= 1


async def test_audit_tenant_slos_and_access_log_at_the_ingress(fleet):
    # The pin test's admin actions, audited as the admin key's id; serve's filters and answers.
    admin = key_id(ADMIN_KEY)
    status, body, _ = await fleet.call("GET", "/v1/audit?adapter=globex&action=pin")
    assert status == 200 and body["object"] == "list" and body["has_more"] is False, body
    assert [(e["action"], e["actor"], e["after"]["pinned"]) for e in body["data"]] == [("pin", admin, True)]
    status, body, _ = await fleet.call("GET", "/v1/audit?adapter=globex&action=unload")
    assert [(e["actor"], e["outcome"]) for e in body["data"]] == [(admin, "ok")]
    status, body, _ = await fleet.call("GET", f"/v1/audit?actor={admin}&limit=1")
    assert status == 200 and len(body["data"]) == 1 and body["has_more"] is True
    newest = body["data"][0]["id"]
    status, body, _ = await fleet.call("GET", f"/v1/audit?actor={admin}&before_id={newest}&limit=1000")
    assert status == 200 and body["data"] and all(e["id"] < newest for e in body["data"])
    assert {e["action"] for e in body["data"]} >= {"register", "deploy", "delete", "unpin"}
    status, body, _ = await fleet.call("GET", "/v1/audit?who=me")
    assert status == 400
    assert_openai_error(body, 400, param="who")
    status, body, _ = await fleet.call("GET", "/v1/audit", key=KEYS["alpha"])
    assert status == 403, body

    # The tenant's SLO series, measured at the ingress, whole answers and streams.
    def completions_logged() -> list[dict]:
        lines = [json.loads(line) for line in fleet.access_log.read_text().splitlines()]
        return [x for x in lines if x["route"] == "/v1/completions"]

    before = len(completions_logged())
    status, got, _ = await fleet.post("/v1/completions", completion("acme"))
    assert status == 200, got
    await fleet.stream(completion("acme"))
    status, text, _ = await fleet.call("GET", "/metrics", key=METRICS_KEY)
    assert 'lorapage_tenant_slo_target_seconds{slo="ttft",tenant="alpha"} 60.0' in text
    assert 'lorapage_tenant_slo_burn_rate{slo="ttft",tenant="alpha"} 0.0' in text
    assert 'lorapage_tenant_goodput_ratio{tenant="alpha"}' in text
    answered = next(x for x in text.splitlines() if x.startswith('lorapage_tenant_requests_total{tenant="alpha"}'))
    assert float(answered.split()[-1]) >= 2

    # One access-log line per answer, the stream's once it ended.
    async def logged():
        got = completions_logged()
        return got[before:] if len(got) >= before + 2 else None

    mine = await eventually(logged)
    assert [(x["tenant"], x["status"], x["model"]) for x in mine] == [("alpha", 200, "acme")] * 2
    assert all(x["adapter"].startswith("acme@") and x["tier"] in ("gpu", "ram", "disk") for x in mine)
    assert all(0 < x["ttft_s"] <= x["e2e_s"] and x["prompt_tokens"] > 0 for x in mine)
    lines = [json.loads(line) for line in fleet.access_log.read_text().splitlines()]
    refused = [x for x in lines if x["route"] == "/v1/audit" and x["status"] == 403]
    assert refused and refused[-1]["request_id"] is None and "tenant" not in refused[-1]
    assert "Hello there" not in fleet.access_log.read_text()  # never prompt text


def replica_series(text: str, name: str, tenant: str) -> dict[str, float]:
    """One re-exported engine counter of ``tenant``, by replica."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'tenant="{tenant}"' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = float(line.split()[-1])
    return out


async def test_usage_sums_every_replicas_ledger(fleet):
    # The earlier tests spread alpha's requests over both replicas (the spill test among them).
    async def agree():
        status, body, _ = await fleet.call("GET", "/v1/usage?tenant=alpha")
        assert status == 200, body
        status, text, _ = await fleet.call("GET", "/metrics", key=METRICS_KEY)
        by_replica = replica_series(text, "lorapage_tenant_served_output_tokens_total", "alpha")
        fleet_total = sum(row["output_tokens"] for row in body["data"])
        return (body, by_replica) if fleet_total == sum(by_replica.values()) else None

    body, by_replica = await eventually(agree)
    assert len([v for v in by_replica.values() if v > 0]) == 2  # both replicas' ledgers are in the sum
    assert body["object"] == "list" and {row["tenant"] for row in body["data"]} == {"alpha"}
    assert body["total"]["output_tokens"] == sum(by_replica.values())
    assert any(row["adapter"].startswith("acme@") and row["requests"] > 0 for row in body["data"])
    keys = [(row["hour"], row["tenant"], row["adapter"]) for row in body["data"]]
    assert keys == sorted(set(keys))  # one row per (hour, tenant, adapter version): summed, not listed twice

    # A tenant key: its own rows only, as lorapage serve answers; CSV too.
    status, mine, _ = await fleet.call("GET", "/v1/usage", key=KEYS["beta"])
    assert status == 200 and all(row["tenant"] in ("beta", "") for row in mine["data"])
    status, body, _ = await fleet.call("GET", "/v1/usage?tenant=alpha", key=KEYS["beta"])
    assert status == 403
    assert_openai_error(body, 403, param="tenant")
    status, text, headers = await fleet.call("GET", "/v1/usage?format=csv&adapter=acme")
    assert status == 200 and headers["Content-Type"].startswith("text/csv")
    assert text.splitlines()[0].startswith("hour,tenant,adapter,requests")
    status, body, _ = await fleet.call("GET", "/v1/usage?format=xml")
    assert status == 400


async def test_the_ingress_sums_every_replicas_traffic_and_judges_the_tier_once(fleet):
    # acme ran on both replicas (the spill test): the ingress's table holds their counts summed,
    # the ledgers' own requests, and judges it hot there; each replica keeps it resident (kept_hot).
    async def summed():
        _, out, _ = await fleet.call("GET", "/v1/adapters/acme")
        _, usage, _ = await fleet.call("GET", f"/v1/usage?adapter=acme@{out['version']}")
        ledgers = sum(row["requests"] for row in usage["data"])
        traffic = out["traffic"]
        return (out, ledgers) if traffic and traffic["last_24h"]["requests"] == ledgers else None

    out, ledgers = await eventually(summed)
    assert ledgers >= HOT_REQUESTS + CAPACITY, ledgers
    assert sum(h["requests"] for h in out["traffic"]["hours"]) == ledgers
    assert out["traffic"]["last_24h"]["output_tokens"] > 0

    async def hot_everywhere():
        _, out, _ = await fleet.call("GET", "/v1/adapters/acme")
        _, state, _ = await fleet.call("GET", "/internal/state")
        kept = [stats["adapters_kept_hot"] for stats in state["replicas"].values()]
        return out if out["traffic_tier"] == "hot" and out["kept_hot"] and min(kept) >= 1 else None

    await eventually(hot_everywhere)


async def test_tenants_reload_and_ingress_restart_keep_the_registry(fleet):
    app = serve.get_app_handle(APP_NAME)
    source = f"{fleet.adapter_root}/initech"
    status, _, _ = await fleet.call("POST", "/v1/adapters", {"id": "keeper", "tenant": "delta", "source": source})
    assert status == 400  # no tenant delta yet
    reloaded = TENANTS_TOML + f'\n[tenants.delta]\nkey_sha256 = ["{hash_key("key-delta")}"]\nadapters = []\n'
    assert "reloaded" in await app.reload_tenants.remote(reloaded)
    assert "not reloaded" in await app.reload_tenants.remote("[tenants.bad]\nkey_sha256 = 3\n")
    status, body, _ = await fleet.call("GET", "/v1/audit?action=tenants_reload&actor=sighup")
    assert [e["outcome"] for e in body["data"]][:2] == ["refused: the file did not load (TenantsConfigError)", "ok"]
    assert "delta" in body["data"][1]["after"]["tenants"]
    status, body, _ = await fleet.call("POST", "/v1/adapters", {"id": "keeper", "tenant": "delta", "source": source})
    assert status == 201, body
    status, got, _ = await fleet.call("POST", "/v1/completions", completion("keeper"), key="key-delta")
    assert status == 200 and got["choices"][0]["text"] == DEMO_MARKERS["initech"]

    # Ray restarts a killed ingress; it reopens the registry and the reloaded tenants file.
    ingress = next(n for n in ray.util.list_named_actors(all_namespaces=True) if "#FleetIngress#" in n["name"])
    ray.kill(ray.get_actor(ingress["name"], namespace=ingress["namespace"]), no_restart=False)

    async def served():
        try:
            status, got, _ = await fleet.call("POST", "/v1/completions", completion("keeper"), key="key-delta")
        except aiohttp.ClientError:
            return None
        return got if status == 200 else None

    got = await eventually(served, timeout_s=60)
    assert got["choices"][0]["text"] == DEMO_MARKERS["initech"]


async def test_killed_replica_loses_no_request_that_had_not_streamed(fleet):
    victim = owner("globex")
    # ignore_eos: every answer runs its 400 tokens, so none can finish on the victim before the kill
    # (a seed's answer may end at EOS in a dozen tokens, quicker than the kill on a loaded machine).
    long = completion("globex", temperature=2.0, max_tokens=400, ignore_eos=True)
    whole = [asyncio.create_task(fleet.post("/v1/completions", {**long, "seed": i})) for i in range(3)]
    started = asyncio.Event()
    streamed = asyncio.create_task(fleet.stream({**long, "seed": 99}, started))
    await asyncio.wait_for(started.wait(), 30)
    replica = next(n for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].endswith(f"#{victim}"))
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)

    # The whole answers had sent nothing yet: resent to the other replica, they all succeed.
    for status, body, headers in await asyncio.gather(*whole):
        assert status == 200, body
        assert body["usage"]["completion_tokens"] >= 1 and headers[REPLICA_HEADER] != victim
    # The stream had started on the victim: it ends with a retryable error event, then [DONE].
    headers, events = await streamed
    assert headers[REPLICA_HEADER] == victim
    assert events[-1]["error"]["code"] == "unavailable" and events[-1]["error"]["type"] == "server_error"
    status, body, headers = await fleet.post("/v1/completions", completion("globex"))
    assert status == 200 and body["choices"][0]["text"] == expected_text("globex")

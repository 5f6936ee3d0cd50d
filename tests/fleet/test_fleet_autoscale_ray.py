"""An autoscaled fleet on a local Ray scales 1 -> 2 -> 1 under a load ramp, losing no request.

One fleet of the tiny model (replicas of 0.5 CPU, ``affinity_load`` placement) autoscaled between
one and two engine replicas by :mod:`lorapage.fleet.autoscale`'s policy, with short delays and a
small tokens-in-flight target so that a few streams cross it. Real HTTP from 127.0.0.1 to the
ingress: a ramp of concurrent streamed completions (``ignore_eos``, so each holds its tokens in
flight) on two adapters until the second replica has joined and served, then one stream at a time
while the fleet scales back down. Checked:

- the fleet reaches two replicas, then returns to one, and every request of the ramp answered 200
  and streamed to ``[DONE]`` (the leaving replica drained, none failed);
- the joined replica took traffic only once the adapters it owns were resident: every adapter
  request it served found its adapter in its pool (``lorapage_adapter_requests_total{tier="gpu"}``
  at the ingress's ``/metrics``, which re-exports each replica's series), while the first replica's
  first requests found theirs on disk (so the series does tell a cold start).

Everything is polled under generous deadlines; no wall-clock time is asserted.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest

ray = pytest.importorskip("ray", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")
serve = pytest.importorskip("ray.serve", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from server_harness import KEYS, METRICS_KEY, TENANTS_TOML  # noqa: E402
from test_fleet_ray import _free_port  # noqa: E402

from lorapage.config import EngineConfig  # noqa: E402
from lorapage.fleet.app import APP_NAME, ENGINE_DEPLOYMENT, build_app  # noqa: E402
from lorapage.fleet.autoscale import AutoscaleConfig  # noqa: E402
from lorapage.fleet.backend import REPLICA_HEADER  # noqa: E402
from lorapage.fleet.config import FleetConfig  # noqa: E402
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ADAPTERS = ("acme", "globex")  # alpha's
MAX_TOKENS = 160  # each ramp stream holds ~170 tokens in flight while it runs (ignore_eos)
RAMP = 6  # concurrent streams at the peak: ~1,000 tokens in flight, past two replicas' target
TAIL, TAIL_TOKENS = 2, 48  # after the ramp: two short streams back to back (~110 tokens: one replica's work)
TARGET_TOKENS = 300.0  # tokens in flight one replica should hold
SCALE_TIMEOUT_S = 240.0  # a new replica's start (a Ray worker importing torch) on a loaded 2-core machine


@pytest.fixture(scope="module")
def fleet_url() -> Iterator[str]:
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
    )
    port = _free_port()
    config = FleetConfig(
        engine=EngineConfig(model=str(TINY_BASE_DIR), device="cpu", max_num_seqs=4),
        tenants_toml=TENANTS_TOML,
        lora_modules=tuple((name, str(demo_adapter_dirs()[name])) for name in ADAPTERS),
        replicas=1,
        replica_cpus=0.5,
        ingress_cpus=0.25,
        router="affinity_load",
        autoscale=AutoscaleConfig(
            min_replicas=1,
            max_replicas=2,
            target_tokens=TARGET_TOKENS,
            max_num_seqs=4,
            upscale_delay_s=1.0,
            downscale_delay_s=2.0,
            metrics_interval_s=0.5,
            look_back_period_s=1.0,
        ),
        routing_stats_period_s=0.5,
        sync_period_s=0.5,
        port=port,
    )
    try:
        serve.start(proxy_location="Disabled")
        serve.run(build_app(config), name=APP_NAME, route_prefix=None)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_states() -> Counter[str]:
    """The engine deployment's replicas by state (RUNNING, STARTING, STOPPING...), as Ray has them."""
    deployment = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
    return Counter({str(getattr(s, "value", s)): n for s, n in deployment.replica_states.items() if n})


async def until(check, what: str, timeout_s: float = SCALE_TIMEOUT_S, every_s: float = 0.5):
    """``check()``'s value once it is truthy, polled; fails naming ``what`` past the deadline."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (got := await check()):
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s:g}s: {what}"
        await asyncio.sleep(every_s)
    return got


async def adapter_requests(session: aiohttp.ClientSession, url: str) -> dict[str, Counter[str]]:
    """Per replica, its adapter requests by the tier the adapter was in when they arrived."""
    async with session.get(url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}) as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, Counter[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "lorapage_adapter_requests_total" and "replica" in sample.labels:
                out.setdefault(sample.labels["replica"], Counter())[sample.labels["tier"]] += int(sample.value)
    return out


async def stream_one(
    session: aiohttp.ClientSession, url: str, adapter: str, seed: int, max_tokens: int
) -> tuple[str, str]:
    """One streamed completion: ("ok" once it reached ``[DONE]``, else what went wrong; the replica
    that answered)."""
    body = {
        "model": adapter,
        "prompt": f"Ramp request {seed}",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    try:
        async with session.post(
            url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS['alpha']}"}
        ) as resp:
            replica = resp.headers.get(REPLICA_HEADER, "")
            if resp.status != 200:
                return f"HTTP {resp.status}: {(await resp.text())[:200]}", replica
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    return "ok", replica
                if line.startswith("data: ") and "error" in json.loads(line.removeprefix("data: ")):
                    return f"error event: {line[:200]}", replica
            return "the stream ended without data: [DONE]", replica
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}", ""


async def test_load_ramp_scales_one_two_one_warm_and_loses_nothing(fleet_url) -> None:
    url = fleet_url
    outcomes: Counter[str] = Counter()
    tail_served: Counter[str] = Counter()  # replica -> streams of the tail it answered
    width = RAMP  # streams the workers keep going; 0 stops them
    seeds = iter(range(1_000_000))

    async def worker(slot: int, session: aiohttp.ClientSession) -> None:
        while slot < width:
            tail = width == TAIL
            outcome, replica = await stream_one(
                session, url, ADAPTERS[slot % len(ADAPTERS)], next(seeds), TAIL_TOKENS if tail else MAX_TOKENS
            )
            outcomes[outcome] += 1
            tail_served[replica] += tail

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        assert replica_states() == Counter(RUNNING=1)
        workers = [asyncio.create_task(worker(slot, session)) for slot in range(RAMP)]
        first = set(await until(lambda: adapter_requests(session, url), "the first replica served the ramp"))

        async def joined_and_served() -> str | None:
            served = {rid: c for rid, c in (await adapter_requests(session, url)).items() if rid not in first}
            return next((rid for rid, c in served.items() if c.total() >= RAMP), None)

        # The ramp's tokens in flight pass the target: a second replica starts, warms, takes traffic.
        new = await until(joined_and_served, "a second replica joined and served the ramp")
        assert replica_states()["RUNNING"] == 2
        tiers = await adapter_requests(session, url)
        # Warm before traffic: every request the joined replica served found its adapter in its pool.
        assert set(tiers[new]) == {"gpu"}, tiers
        # ... while the first replica's first requests found theirs cold (the series tells one).
        assert tiers[next(iter(first))].total() > tiers[next(iter(first))]["gpu"], tiers

        width = TAIL  # the ramp ends: short streams (under the target) go on while the fleet shrinks

        async def one_replica() -> bool:
            return replica_states() == Counter(RUNNING=1)

        await until(one_replica, "the fleet scaled back down to one replica")
        width = 0
        await asyncio.wait_for(asyncio.gather(*workers), SCALE_TIMEOUT_S)
    # Every request of the ramp and the tail completed, the ones the leaving replica drained included:
    # both replicas served the tail's streams, so the one that left had them until Ray stopped it.
    assert set(outcomes) == {"ok"} and outcomes["ok"] > 2 * RAMP, outcomes
    assert all(tail_served[rid] > 0 for rid in first | {new}), tail_served

"""The fleet's dedicated tier on first use (``--auto-promote``): a request the shared pool refused
for its adapter's shape starts that version's deployment once, waits for it a bounded time, then
goes there or gets a 503 with Retry-After. The ingress's :class:`AutoPromoter` over a stand-in for
the dedicated deployments (no Ray cluster: the deployments' own start is test_fleet_dedicated_ray's)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import pytest

pytest.importorskip("ray", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")

from lorapage.config import EngineConfig  # noqa: E402
from lorapage.errors import ServiceUnavailableError  # noqa: E402
from lorapage.fleet.auto_promote import ACTOR, AutoPromoter  # noqa: E402
from lorapage.fleet.config import FleetConfig  # noqa: E402
from lorapage.fleet.promotion import DedicatedConfig  # noqa: E402

pytestmark = pytest.mark.asyncio


@dataclass
class FakePromotion:
    adapter_id: str
    key: str
    state: str
    actor: str
    since: float
    reason: str | None = None


class FakeDedicated:
    """Starts take ``start_s`` and end ``outcome`` (merged or failed)."""

    def __init__(self, wait_s: float, start_s: float, outcome: str = "merged") -> None:
        config = FleetConfig(engine=EngineConfig(model="unused"), tenants_toml="")
        self.config = replace(config, dedicated=DedicatedConfig(auto=True, wait_s=wait_s))
        self.start_s, self.outcome = start_s, outcome
        self.promotions: dict[str, FakePromotion] = {}
        self.started: list[tuple[str, str]] = []

    def promote(self, key: str, actor: str) -> FakePromotion:
        promotion = FakePromotion(key.partition("@")[0], key, "starting", actor, time.time())
        self.promotions[promotion.adapter_id] = promotion
        self.started.append((key, actor))

        def done() -> None:
            promotion.state, promotion.since = self.outcome, time.time()
            promotion.reason = "merge equivalence check failed" if self.outcome == "failed" else None

        asyncio.get_running_loop().call_later(self.start_s, done)
        return promotion

    def route(self, key: str | None) -> object | None:
        p = self.promotions.get((key or "").partition("@")[0])
        return "merged-handle" if p is not None and p.state == "merged" and p.key == key else None


async def test_the_first_requests_start_one_deployment_and_wait_for_it():
    dedicated = FakeDedicated(wait_s=5.0, start_s=0.2)
    auto = AutoPromoter(dedicated, interval_s=60.0)  # type: ignore[arg-type]
    await asyncio.gather(auto.first_use("wide@1"), auto.first_use("wide@1"))
    assert dedicated.started == [("wide@1", ACTOR)]  # one start for every request that waited
    assert dedicated.route("wide@1") is not None
    await auto.first_use("wide@1")  # served: nothing to wait for
    assert len(dedicated.started) == 1


async def test_past_the_wait_a_503_with_retry_after_and_the_start_goes_on():
    dedicated = FakeDedicated(wait_s=0.1, start_s=0.5)
    auto = AutoPromoter(dedicated, interval_s=60.0)  # type: ignore[arg-type]
    with pytest.raises(ServiceUnavailableError) as refused:
        await auto.first_use("wide@1")
    assert refused.value.retry_after is not None and refused.value.retry_after >= 1
    assert "starting" in refused.value.message
    await asyncio.sleep(0.6)
    await auto.first_use("wide@1")  # the start went on: served now, no second start
    assert len(dedicated.started) == 1


async def test_a_failed_start_is_not_retried_by_every_request():
    dedicated = FakeDedicated(wait_s=5.0, start_s=0.05, outcome="failed")
    auto = AutoPromoter(dedicated, interval_s=60.0)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(ServiceUnavailableError) as refused:
            await auto.first_use("wide@1")
        assert "merge equivalence check failed" in refused.value.message
    assert len(dedicated.started) == 1  # retried after the rules' retry_after_s, not per request
    assert refused.value.retry_after is not None and refused.value.retry_after > 60

"""``--auto-promote``: the ingress carries out :mod:`lorapage.fleet.promotion`'s decisions.

The ingress sees every answer, so it counts each adapter id's output tokens itself (whichever
deployment served it: a merged adapter's traffic is what keeps it merged). Every
``interval_s`` the policy is judged against the dedicated deployments that exist; a promotion
starts the current version's deployment (:meth:`DedicatedDeployments.promote`), a demotion
deletes it. A promotion that fails is reported back to the policy, which waits ``retry_after_s``
before it tries that adapter again. Audited as the admin routes' changes are, as actor
``auto-promotion``, with the rate in the log.

On first use (:meth:`AutoPromoter.first_use`): a request the shared pool refused for its
adapter's shape (outside the shared envelope) starts that version's deployment at once and waits
for it, at most ``wait_s``; then the request goes there, or gets a 503 with ``Retry-After``. A
hot adapter inside the envelope needs no wait: the shared pool serves it until its deployment does.
"""

from __future__ import annotations

import asyncio
import logging
import time

from lorapage.adapters.names import parse_name
from lorapage.errors import LorapageError, ServiceUnavailableError
from lorapage.fleet.dedicated import DedicatedDeployments
from lorapage.fleet.promotion import PromotionPolicy

log = logging.getLogger("lorapage.fleet")

ACTOR = "auto-promotion"


class AutoPromoter:
    """The promotion policy on the ingress's clock, and the loop that carries it out."""

    def __init__(self, dedicated: DedicatedDeployments, interval_s: float) -> None:
        self.dedicated, self.interval_s = dedicated, interval_s
        self.policy = PromotionPolicy(dedicated.config.dedicated.rules, time.monotonic)
        self._failed_seen: dict[str, float] = {}  # id -> the `since` of the failure already reported
        self._task: asyncio.Task | None = None

    def observe(self, adapter: str | None, tokens: int) -> None:
        """One answer's output tokens on version ``adapter`` (None: the base, not counted)."""
        if adapter is not None:
            self.policy.observe(parse_name(adapter)[0], tokens)

    async def first_use(self, key: str) -> None:
        """Version ``key``'s request was refused by the shared pool for its shape: its dedicated
        deployment is started (unless one is starting, or failed within ``retry_after_s``) and
        waited for, at most ``wait_s``. Returns once it serves; else a 503 with Retry-After."""
        adapter_id, wait_s = parse_name(key)[0], self.dedicated.config.dedicated.wait_s
        promotion = self.dedicated.promotions.get(adapter_id)
        retry_s = self.policy.rules.retry_after_s
        recent_failure = promotion is not None and promotion.state == "failed" and promotion.key == key
        if recent_failure and promotion is not None and time.time() - promotion.since < retry_s:
            raise ServiceUnavailableError(
                f"adapter {key!r} is outside the shared envelope and its dedicated deployment failed: "
                f"{promotion.reason}",
                retry_after=max(1, round(retry_s - (time.time() - promotion.since))),
            )
        if promotion is None or promotion.state == "failed":
            promotion = self.dedicated.promote(key, ACTOR)
            log.info("automatic promote of %s: its first request, outside the shared envelope", key)
        deadline = time.monotonic() + wait_s
        while self.dedicated.route(key) is None and promotion.state == "starting" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.dedicated.route(key) is None:
            raise ServiceUnavailableError(
                f"adapter {key!r} is served by a dedicated deployment of its own (its shape is outside the shared "
                f"envelope), which is {promotion.state}" + (f": {promotion.reason}" if promotion.reason else ""),
                retry_after=max(1, round(wait_s)),
            )

    def ensure_running(self) -> None:
        """Start the loop (on the running event loop) unless it runs."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._forever())

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.judge()
            except asyncio.CancelledError:
                raise
            except Exception:  # a registry or Ray hiccup: judged again next time
                log.exception("automatic promotion failed to judge")

    async def judge(self) -> None:
        """One judgement: failures reported to the policy, then its decisions carried out."""
        for adapter_id in self.dedicated.ids("failed"):
            promotion = self.dedicated.promotions.get(adapter_id)
            if promotion is not None and self._failed_seen.get(adapter_id) != promotion.since:
                self._failed_seen[adapter_id] = promotion.since
                self.policy.failed(adapter_id)
        # Its own promotions only: an admin's (or an adopted one) stays until an admin demotes it.
        promotions = self.dedicated.promotions
        merged = {i for i in self.dedicated.ids("merged") if (p := promotions.get(i)) and p.actor == ACTOR}
        busy = self.dedicated.ids("starting", "stopping") | (self.dedicated.ids("merged") - merged)
        for decision in self.policy.decide(merged, busy):
            reason = decision.reason(self.policy.rules)
            try:
                if decision.action == "demote":
                    await self.dedicated.demote(decision.adapter_id, ACTOR)
                else:
                    row = self.dedicated.registry.index.row(decision.adapter_id)  # its current version
                    if row is None:
                        continue
                    self.dedicated.promote(row.key, ACTOR)
            except LorapageError as exc:
                log.info("automatic %s of %s not done: %s", decision.action, decision.adapter_id, exc.message)
                continue
            log.info("automatic %s of %s: %s", decision.action, decision.adapter_id, reason)

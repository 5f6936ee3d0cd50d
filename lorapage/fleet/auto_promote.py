"""``--auto-promote``: the ingress carries out :mod:`lorapage.fleet.promotion`'s decisions.

The ingress sees every answer, so it counts each adapter id's output tokens itself (whichever
deployment served it: a merged adapter's traffic is what keeps it merged). Every
``interval_s`` the policy is judged against the dedicated deployments that exist; a promotion
starts the current version's deployment (:meth:`DedicatedDeployments.promote`), a demotion
deletes it. A promotion that fails is reported back to the policy, which waits ``retry_after_s``
before it tries that adapter again. Audited as the admin routes' changes are, as actor
``auto-promotion``, with the rate in the log.
"""

from __future__ import annotations

import asyncio
import logging
import time

from lorapage.adapters.names import parse_name
from lorapage.errors import LorapageError
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

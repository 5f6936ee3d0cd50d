"""The fleet's one traffic record: the replicas' hourly counts, summed at the ingress, and the
tiers judged once from them.

Each engine replica counts its requests and tokens per (hour, adapter version) in its usage
ledger, as ``lorapage serve`` does; its heartbeat takes those counts
(:class:`~lorapage.fleet.messages.Heartbeat` ``traffic``) and the ingress adds them to the hourly
traffic table of the fleet's registry (the one ``STATE_DIR/registry.sqlite3`` the ingress owns),
so the table holds every replica's traffic summed. The tiers (cold, warm, hot) are judged there,
by the engine's own :class:`~lorapage.engine.tiering.TierKeeper` and rules
(:mod:`lorapage.adapters.tiers`), every ``tier_interval_s``; each heartbeat's reply carries the
latest judgement to a replica that has not seen it, whose engine carries it out (hot versions
kept resident, warm ones read into host RAM) and judges nothing itself
(:meth:`~lorapage.engine.tiering.TierKeeper.follow`). ``merged`` is the dedicated tier's, shown
by the admin routes for a version its dedicated deployment serves.

A report whose reply never came is counted again from the next heartbeat (the replica gives the
counts back to its ledger), so a lost reply may count a few requests twice, never lose them.
A dedicated deployment's replicas send no heartbeats: a merged adapter's traffic there is not in
the table (the ingress's automatic promotion counts it, :mod:`lorapage.fleet.auto_promote`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from lorapage.adapters.tiers import TierRules, TierState
from lorapage.config import EngineConfig
from lorapage.engine.tiering import TierKeeper
from lorapage.registry.store import Registry
from lorapage.registry.traffic import RegistryTraffic
from lorapage.usage.ledger import Traffic, TrafficKey


class TrafficInbox:
    """The replicas' reported counts, summed until the ingress's keeper writes them."""

    def __init__(self) -> None:
        self.traffic: dict[TrafficKey, Traffic] = {}

    def take_traffic(self) -> dict[TrafficKey, Traffic]:
        taken, self.traffic = self.traffic, {}
        return taken

    def restore_traffic(self, taken: Mapping[TrafficKey, Traffic]) -> None:
        """Add ``taken`` (a replica's report, or counts a write could not commit)."""
        for key, t in taken.items():
            mine = self.traffic.setdefault(key, Traffic())
            mine.requests += t.requests
            mine.prompt_tokens += t.prompt_tokens
            mine.output_tokens += t.output_tokens


def fleet_tiers(
    config: EngineConfig, registry: Registry, wall_clock: Callable[[], float]
) -> tuple[TierKeeper, TrafficInbox]:
    """The ingress's keeper over ``registry``'s traffic table (judging with the engines' ``tier_*``
    rules, carrying nothing out) and the inbox the replicas' reports go to."""
    inbox = TrafficInbox()
    keeper = TierKeeper(
        TierRules.from_config(config),
        inbox,
        RegistryTraffic(registry),
        None,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorapage-fleet-traffic"),
        wall_clock,
        interval_s=config.tier_interval_s,
        retention_hours=config.traffic_retention_hours,
        audit_retention_s=config.audit_retention_days * 86400,
    )
    return keeper, inbox


def tiers_for(keeper: TierKeeper, seen: int, full: bool) -> dict[str, TierState] | None:
    """The tiers a replica that has carried out judgement ``seen`` must get (None: it has them)."""
    return dict(keeper.states) if full or seen != keeper.judged else None

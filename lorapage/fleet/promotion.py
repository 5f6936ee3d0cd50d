"""When an adapter gets a dedicated merged deployment of its own, and when it goes back (pure, clock-injected).

Seed 001: "dedicated merged replicas for a customer whose own traffic fills a replica, here more
than 640 tokens per second" (a replica runs 32 requests at 50 ms a token with unmerged adapters:
32 / 0.05 = 640 output tokens a second). Seed 000 §9: the head of the distribution is merged, the
tail stays on the shared pool. So the rule here, per adapter id, on its own output tokens a second
(an exponentially decaying count, half-life ``half_life_s``, on the injected clock):

- **promote** once its rate has stayed at or above ``promote_tokens_per_s`` for ``promote_after_s``
  (a burst does not start a whole deployment), the busiest first while fewer than
  ``max_deployments`` dedicated deployments exist or start; not within ``retry_after_s`` of a
  promotion of it that failed (its equivalence check, or Ray could not place it);
- **demote** once its rate has stayed below ``demote_tokens_per_s`` (lower than the promotion
  threshold: hysteresis) for ``demote_after_s``; a rate back at or over it restarts that wait, so
  traffic that wobbles between the two thresholds changes nothing.

No torch, no Ray: the fleet's ingress drives it (:mod:`lorapage.fleet.auto_promote`), so does
``lorapage serve --auto-promote`` (:mod:`lorapage.serve.dedicated`: this module has a layer of its
own below both), and the simulator can. The rules' flags are declared here once, for both commands.
Merged traffic is still the adapter's traffic: the ingress counts every answer, whichever
deployment served it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

from lorapage.fleet.routing.placement import DecayingCounts

# Seed 001: 32 requests / 0.05 s a token, unmerged = one replica's decode throughput.
REPLICA_TOKENS_PER_S = 640.0


@dataclass(frozen=True)
class PromotionRules:
    """The thresholds of automatic promotion and demotion (see the module's docstring)."""

    promote_tokens_per_s: float = REPLICA_TOKENS_PER_S
    demote_tokens_per_s: float = REPLICA_TOKENS_PER_S / 2
    promote_after_s: float = 60.0
    demote_after_s: float = 600.0  # as the traffic tiers' min_hold_s: a dedicated deployment is not started for minutes
    half_life_s: float = 30.0
    max_deployments: int = 4  # dedicated deployments at once (each holds a whole replica's resources)
    retry_after_s: float = 3600.0  # after a failed promotion of an adapter, before an automatic retry
    max_tracked: int = 10_000  # adapters whose rate is remembered (least recently seen forgotten first)

    def __post_init__(self) -> None:
        if not 0 <= self.demote_tokens_per_s < self.promote_tokens_per_s < math.inf:
            raise ValueError(
                "the demotion threshold must be below the promotion threshold (hysteresis): 0 <= "
                f"demote_tokens_per_s < promote_tokens_per_s; got {self.demote_tokens_per_s:g} and "
                f"{self.promote_tokens_per_s:g}"
            )
        if min(self.promote_after_s, self.demote_after_s, self.retry_after_s) < 0 or self.half_life_s <= 0:
            raise ValueError("promote_after_s, demote_after_s and retry_after_s must be >= 0, half_life_s > 0")
        if self.max_deployments < 0 or self.max_tracked < 1:
            raise ValueError("max_deployments must be >= 0 and max_tracked >= 1")


@dataclass(frozen=True)
class DedicatedConfig:
    """The fleet's dedicated tier: replicas per merged deployment, the automatic rules, and how
    long a new deployment may take to start (placing it, loading the base, merging, checking)."""

    replicas: int = 1
    auto: bool = False  # promote and demote by PromotionRules (else only by the admin routes)
    rules: PromotionRules = PromotionRules()
    interval_s: float = 5.0  # how often the automatic rules are judged
    start_timeout_s: float = 300.0
    check_prompts: int = 32  # of the adapter's stored check prompts, beside the built-in ones
    wait_s: float = 30.0  # with auto: a first request's wait for a deployment started by its use (then 503)

    def __post_init__(self) -> None:
        if (
            self.replicas < 1
            or self.interval_s <= 0
            or self.start_timeout_s <= 0
            or self.check_prompts < 0
            or not 0 < self.wait_s < math.inf
        ):
            raise ValueError(
                "dedicated replicas must be >= 1, interval_s, start_timeout_s and wait_s > 0, check_prompts >= 0; "
                f"got {self.replicas}, {self.interval_s}, {self.start_timeout_s}, {self.wait_s}, {self.check_prompts}"
            )


@dataclass(frozen=True)
class Decision:
    """One change the rules ask for, with the rate it was judged on."""

    action: Literal["promote", "demote"]
    adapter_id: str
    tokens_per_s: float

    def reason(self, rules: PromotionRules) -> str:
        """Why, for the audit row and the log."""
        if self.action == "promote":
            return (
                f"{self.tokens_per_s:.0f} output tokens/s >= {rules.promote_tokens_per_s:g} "
                f"for {rules.promote_after_s:g}s (its own traffic fills a replica)"
            )
        return f"{self.tokens_per_s:.0f} output tokens/s < {rules.demote_tokens_per_s:g} for {rules.demote_after_s:g}s"


class PromotionPolicy:
    """Each adapter's output tokens a second, and the promotions and demotions they call for."""

    def __init__(self, rules: PromotionRules, clock: Callable[[], float]) -> None:
        self.rules, self.clock = rules, clock
        self.rates = DecayingCounts(rules.half_life_s, rules.max_tracked)
        self._above_since: dict[str, float] = {}  # id -> since when its rate is >= promote (not dedicated)
        self._below_since: dict[str, float] = {}  # id -> since when its rate is < demote (dedicated)
        self._failed_at: dict[str, float] = {}  # id -> when its last promotion failed

    def observe(self, adapter_id: str, tokens: int) -> None:
        """``tokens`` output tokens of one answer on ``adapter_id`` (whichever deployment served it)."""
        if tokens > 0:
            now = self.clock()
            self.rates.add(adapter_id, now, float(tokens))
            if self.rates.rate(adapter_id, now) >= self.rules.promote_tokens_per_s:  # its wait starts here
                self._above_since.setdefault(adapter_id, now)

    def failed(self, adapter_id: str) -> None:
        """A promotion of ``adapter_id`` failed: no automatic retry for ``retry_after_s``."""
        self._failed_at[adapter_id] = self.clock()
        self._above_since.pop(adapter_id, None)

    def decide(self, merged: Collection[str], starting: Collection[str] = ()) -> list[Decision]:
        """The demotions of ``merged`` adapters (serving on their dedicated deployment) and the
        promotions of others the rules call for now; ``starting`` ones are left alone but count
        against ``max_deployments``."""
        now, rules = self.clock(), self.rules
        demotions = [d for i in merged if (d := self._demotion(i, now)) is not None]
        for gone in set(self._below_since) - set(merged):
            del self._below_since[gone]
        dedicated = set(merged) | set(starting)
        ready = []
        for adapter_id in {*self.rates.keys(), *self._above_since} - dedicated:
            rate = self.rates.rate(adapter_id, now)
            if rate < rules.promote_tokens_per_s:
                self._above_since.pop(adapter_id, None)
                continue
            since = self._above_since.setdefault(adapter_id, now)
            failed = self._failed_at.get(adapter_id)
            if now - since >= rules.promote_after_s and (failed is None or now - failed >= rules.retry_after_s):
                ready.append(Decision("promote", adapter_id, rate))
        room = rules.max_deployments - len(dedicated) + len(demotions)
        ready.sort(key=lambda d: (-d.tokens_per_s, d.adapter_id))
        return [*demotions, *ready[: max(room, 0)]]

    def _demotion(self, adapter_id: str, now: float) -> Decision | None:
        rate = self.rates.rate(adapter_id, now)
        if rate >= self.rules.demote_tokens_per_s:
            self._below_since.pop(adapter_id, None)
            return None
        since = self._below_since.setdefault(adapter_id, now)
        if now - since < self.rules.demote_after_s:
            return None
        del self._below_since[adapter_id]
        return Decision("demote", adapter_id, rate)


def add_rule_arguments(group: argparse._ArgumentGroup) -> None:
    """The automatic rules' flags (``lorapage fleet`` and ``lorapage serve``; defaults: the
    design's, seed 001's 640 tokens/s a replica)."""
    rules = PromotionRules()
    group.add_argument(
        "--promote-tokens-per-s",
        type=float,
        default=rules.promote_tokens_per_s,
        help="an adapter's own output tokens a second that fill a replica (seed 001: 32 rows / 50 ms = 640)",
    )
    group.add_argument(
        "--demote-tokens-per-s",
        type=float,
        default=rules.demote_tokens_per_s,
        help="below this (and below the promotion threshold: hysteresis) a promoted adapter goes back to the pool",
    )
    group.add_argument("--promote-after", type=float, default=rules.promote_after_s, help="seconds over, to promote")
    group.add_argument("--demote-after", type=float, default=rules.demote_after_s, help="seconds under, to demote")
    group.add_argument(
        "--max-dedicated",
        type=int,
        default=rules.max_deployments,
        help="dedicated deployments --auto-promote may hold at once (the admin route is not bounded by it)",
    )


def rules_from(args: argparse.Namespace) -> PromotionRules:
    """The rules :func:`add_rule_arguments`' flags ask for (ValueError: a bad value)."""
    return PromotionRules(
        promote_tokens_per_s=args.promote_tokens_per_s,
        demote_tokens_per_s=args.demote_tokens_per_s,
        promote_after_s=args.promote_after,
        demote_after_s=args.demote_after,
        max_deployments=args.max_dedicated,
    )

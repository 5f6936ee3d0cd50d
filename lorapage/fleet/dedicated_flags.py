"""``lorapage fleet``'s flags of the dedicated tier: merged deployments of promoted adapters,
and the automatic promotion rules (:mod:`lorapage.fleet.promotion`)."""

from __future__ import annotations

import argparse

from lorapage.flags import fail
from lorapage.fleet.promotion import DedicatedConfig, add_rule_arguments, rules_from

_DEFAULTS = DedicatedConfig()


def add_dedicated_arguments(p: argparse.ArgumentParser) -> None:
    """The flags (defaults: the design's, seed 001's 640 tokens/s a replica)."""
    group = p.add_argument_group("dedicated tier (adapters promoted to a deployment with their weights merged)")
    group.add_argument(
        "--dedicated-replicas",
        type=int,
        default=_DEFAULTS.replicas,
        help="replicas of each dedicated deployment (each reserves --replica-cpus / --replica-gpus)",
    )
    group.add_argument(
        "--dedicated-start-timeout",
        type=float,
        default=_DEFAULTS.start_timeout_s,
        help="seconds a dedicated deployment gets to be placed, merged and checked; past it the promotion fails",
    )
    group.add_argument(
        "--auto-promote",
        action="store_true",
        help="promote an adapter whose own output tokens/s stays >= --promote-tokens-per-s for --promote-after "
        "seconds (the shared pool serves it meanwhile), and an adapter outside the shared envelope on its first "
        "request (which waits at most --dedicated-wait seconds, then gets a 503 with Retry-After); demote either "
        "once its tokens/s stay < --demote-tokens-per-s for --demote-after seconds",
    )
    group.add_argument(
        "--dedicated-wait",
        type=float,
        default=_DEFAULTS.wait_s,
        metavar="SECONDS",
        help="with --auto-promote: how long a request waits for the dedicated deployment its first use started",
    )
    add_rule_arguments(group)


def dedicated_config(args: argparse.Namespace, prog: str) -> DedicatedConfig:
    """The dedicated tier the flags ask for; a bad value ends the command naming it."""
    try:
        rules = rules_from(args)
        return DedicatedConfig(
            replicas=args.dedicated_replicas,
            auto=args.auto_promote,
            rules=rules,
            start_timeout_s=args.dedicated_start_timeout,
            wait_s=args.dedicated_wait,
        )
    except ValueError as exc:
        fail(prog, f"--auto-promote / --dedicated-*: {exc}")

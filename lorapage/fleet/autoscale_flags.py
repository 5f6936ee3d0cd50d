"""``lorapage fleet``'s autoscaling flags (:mod:`lorapage.fleet.autoscale`): ``--max-replicas``
turns it on, ``--replicas`` is then the fewest (and the start)."""

from __future__ import annotations

import argparse

from lorapage.flags import fail
from lorapage.fleet.autoscale import AutoscaleConfig

_DEFAULTS = AutoscaleConfig()


def add_autoscale_arguments(p: argparse.ArgumentParser) -> None:
    """The flags (defaults in docs/fleet.md, "Autoscaling")."""
    group = p.add_argument_group("autoscaling (engine replicas by queue depth, tokens in flight and KV headroom)")
    group.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="autoscale the engine replicas between --replicas and this many (default: a fixed --replicas)",
    )
    group.add_argument(
        "--scale-target-tokens",
        type=float,
        default=_DEFAULTS.target_tokens,
        help="tokens in flight (prompt + remaining output, queued or running) one replica should hold",
    )
    group.add_argument(
        "--scale-target-queue",
        type=float,
        default=_DEFAULTS.target_queue,
        help="queued requests a replica may hold before the queue itself calls for more replicas",
    )
    group.add_argument(
        "--scale-headroom",
        type=float,
        default=_DEFAULTS.headroom,
        help="square-root staffing: want ceil(L + this * sqrt(L)) replicas for L replicas' worth of tokens",
    )
    group.add_argument(
        "--scale-smoothing",
        type=float,
        default=_DEFAULTS.smoothing_s,
        help="seconds over which the tokens in flight are averaged (exponentially) before they are read",
    )
    group.add_argument(
        "--scale-lead",
        type=float,
        default=_DEFAULTS.lead_s,
        help="seconds ahead a rising tokens slope is projected (a replica's base load; needs --scale-smoothing)",
    )
    group.add_argument(
        "--upscale-delay", type=float, default=_DEFAULTS.upscale_delay_s, help="seconds more replicas must be wanted"
    )
    group.add_argument(
        "--downscale-delay",
        type=float,
        default=_DEFAULTS.downscale_delay_s,
        help="seconds fewer replicas must be wanted before one drains and leaves",
    )
    group.add_argument(
        "--scale-metrics-interval",
        type=float,
        default=_DEFAULTS.metrics_interval_s,
        help="seconds between each replica's reports to Ray's autoscaler (Ray's metrics_interval_s)",
    )
    group.add_argument(
        "--scale-look-back",
        type=float,
        default=_DEFAULTS.look_back_period_s,
        help="seconds of reports Ray averages each replica's over (Ray's look_back_period_s)",
    )


def autoscale_config(args: argparse.Namespace, max_num_seqs: int, prog: str) -> AutoscaleConfig | None:
    """The policy's options, or None without ``--max-replicas``."""
    if args.max_replicas is None:
        return None
    try:
        return AutoscaleConfig(
            min_replicas=args.replicas,
            max_replicas=args.max_replicas,
            target_tokens=args.scale_target_tokens,
            target_queue=args.scale_target_queue,
            max_num_seqs=max_num_seqs,
            upscale_delay_s=args.upscale_delay,
            downscale_delay_s=args.downscale_delay,
            metrics_interval_s=args.scale_metrics_interval,
            look_back_period_s=args.scale_look_back,
            headroom=args.scale_headroom,
            smoothing_s=args.scale_smoothing,
            lead_s=args.scale_lead,
        )
    except ValueError as exc:
        fail(prog, f"--replicas / --max-replicas / scaling flags: {exc}")

"""Autoscaling on the engine's own signals: pure, clock-injected, one code for Ray Serve and the simulator.

Each replica reports its queue depth (requests waiting for admission), tokens in flight (prompt +
remaining output tokens of what it runs and queues: the work it holds) and KV headroom (free
fraction of its page pool). :func:`wanted` turns one set of reports into the replica count they
call for, :func:`decide` adds the hysteresis:

- **tokens**: ``ceil(sum(tokens_in_flight) / target_tokens)``: a replica should hold about
  ``target_tokens`` of work (the seed's replica at 32 rows of ~800-token prompts and ~250-token
  outputs holds ~30,000 when full; the default 20,000 keeps a third of it for bursts);
- **queue**: requests queued beyond ``target_queue`` a replica call for one more replica per
  ``max_num_seqs`` of them (a queue is work the batch has no row for yet);
- **KV**: a mean free KV fraction below ``kv_reserve`` calls for one more replica (KV binds
  before rows: long prompts);
- clamped to ``[min_replicas, max_replicas]``.

Three options shape the tokens signal (all off by default: the signal above, each report as it comes):

- ``headroom`` (square-root staffing): ``ceil(L + headroom * sqrt(L))`` for ``L = tokens /
  target_tokens``, so ``target_tokens`` can be a nearly full replica and the spare room grows with
  the square root of the load (the relative noise of many streams shrinks as their number grows);
- ``smoothing_s``: the tokens are read as their exponential mean over this time (state ``tokens``),
  so the noise of single reports neither adds replicas nor resets a scale-down wait;
- ``lead_s``: a rising slope of the tokens (from their means over ``smoothing_s`` and twice that)
  projects them this far ahead, so a replica whose base takes ``lead_s`` to load is asked for in time.

:func:`decide` scales up once the count wanted has stayed above the current one for
``upscale_delay_s`` (to the least it wanted over that time, so a one-report burst adds nothing),
and down once it has stayed below for ``downscale_delay_s`` (to the most it wanted over that time,
and by at most ``max_downscale`` replicas at once). Its state is a plain dict (Ray Serve keeps a
custom policy's ``policy_state`` between calls); :class:`Autoscaler` holds it for a caller with a
clock (the simulator's virtual one). :class:`RayAutoscalingPolicy` is the same decision as Ray
Serve's custom autoscaling policy (``AutoscalingConfig(policy=AutoscalingPolicy(policy_function=
RayAutoscalingPolicy, policy_kwargs=...))``, Ray >= 2.5x), reading the replicas'
``record_autoscaling_stats`` metrics from the context.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

METRICS = ("queue_depth", "tokens_in_flight", "kv_free")  # what record_autoscaling_stats reports


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's report: requests queued, tokens in flight, free KV fraction (0-1)."""

    queue_depth: float = 0.0
    tokens_in_flight: float = 0.0
    kv_free: float = 1.0


@dataclass(frozen=True)
class AutoscaleConfig:
    """The policy's options (``lorapage fleet --min-replicas`` etc.; defaults in docs/fleet.md)."""

    min_replicas: int = 1
    max_replicas: int = 32
    target_tokens: float = 20_000.0  # tokens in flight one replica should hold
    target_queue: float = 4.0  # queued requests a replica may have before its queue calls for more
    max_num_seqs: int = 32  # a replica's batch rows: queued requests per extra replica
    kv_reserve: float = 0.05  # mean free KV fraction under which one more replica is wanted
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 300.0
    max_downscale: int = 4  # replicas removed by one decision at most
    # Ray Serve only (the simulator reads its replicas directly): how often each replica's
    # record_autoscaling_stats reaches the controller, and the window Ray averages them over.
    metrics_interval_s: float = 1.0
    look_back_period_s: float = 5.0
    # Square-root staffing: the tokens signal wants ceil(L + headroom * sqrt(L)) replicas for a load
    # of L = tokens / target_tokens (0: ceil(L), a fixed share of headroom in target_tokens alone).
    headroom: float = 0.0
    # Scale-down reads the tokens as an exponential mean over this many seconds (0: each report as
    # it comes); scale-up always reads them as they come.
    smoothing_s: float = 0.0
    # Predictive scale-up (needs smoothing_s): the tokens' slope (from their means over smoothing_s
    # and twice that) projects them this many seconds ahead; a replica's base load is the lead to cover.
    lead_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1; "
                f"got {self.min_replicas}, {self.max_replicas}"
            )
        if self.target_tokens <= 0 or self.target_queue < 0 or self.max_num_seqs < 1 or self.max_downscale < 1:
            raise ValueError(
                "need target_tokens > 0, target_queue >= 0, max_num_seqs >= 1 and max_downscale >= 1; got "
                f"{self.target_tokens}, {self.target_queue}, {self.max_num_seqs}, {self.max_downscale}"
            )
        if min(self.metrics_interval_s, self.look_back_period_s) <= 0:
            raise ValueError(
                f"need metrics_interval_s > 0 and look_back_period_s > 0; got "
                f"{self.metrics_interval_s}, {self.look_back_period_s}"
            )
        if min(self.headroom, self.smoothing_s, self.lead_s) < 0 or (self.lead_s > 0 and not self.smoothing_s):
            raise ValueError(
                "need headroom, smoothing_s and lead_s >= 0, and smoothing_s > 0 for a lead_s; got "
                f"{self.headroom}, {self.smoothing_s}, {self.lead_s}"
            )
        if not 0 <= self.kv_reserve < 1 or min(self.upscale_delay_s, self.downscale_delay_s) < 0:
            raise ValueError(
                f"need 0 <= kv_reserve < 1 and delays >= 0; got {self.kv_reserve}, "
                f"{self.upscale_delay_s}, {self.downscale_delay_s}"
            )


def wanted(loads: Sequence[ReplicaLoad], current: int, config: AutoscaleConfig, tokens: float | None = None) -> int:
    """The replica count these reports call for now (no hysteresis), within the bounds; ``tokens``
    replaces the reports' sum of tokens in flight (a smoothed one)."""
    n = max(current, 1)
    load = (sum(r.tokens_in_flight for r in loads) if tokens is None else tokens) / config.target_tokens
    by_tokens = math.ceil(load + config.headroom * math.sqrt(load))
    queued = sum(r.queue_depth for r in loads)
    excess = queued - config.target_queue * n
    by_queue = n + math.ceil(excess / config.max_num_seqs) if excess > 0 else 0
    by_kv = n + 1 if loads and sum(r.kv_free for r in loads) / len(loads) < config.kv_reserve else 0
    return min(max(by_tokens, by_queue, by_kv, config.min_replicas), config.max_replicas)


def desired(
    loads: Sequence[ReplicaLoad], now: float, state: Mapping[str, Any], config: AutoscaleConfig, current: int
) -> tuple[int, dict[str, Any]]:
    """The replica count these reports call for now (:func:`wanted`, the tokens read as the
    options say), and the tokens' means to keep in the state (with ``smoothing_s``)."""
    if config.smoothing_s <= 0:
        return wanted(loads, current, config), {}
    raw, tau = float(sum(r.tokens_in_flight for r in loads)), config.smoothing_s
    fast = slow = raw
    if "tokens" in state:
        dt = max(now - state["tokens_at"], 0.0)
        w1, w2 = math.exp(-dt / tau), math.exp(-dt / (2 * tau))
        fast, slow = w1 * state["tokens"] + (1 - w1) * raw, w2 * state["tokens_slow"] + (1 - w2) * raw
    keep = {"tokens": fast, "tokens_slow": slow, "tokens_at": now}
    # On a ramp of r tokens/s the two means lag tau * r and 2 tau * r: r = (fast - slow) / tau;
    # a rising one is projected lead_s ahead of now.
    tokens = fast + max(fast - slow, 0.0) / tau * (tau + config.lead_s) if config.lead_s > 0 else fast
    return wanted(loads, current, config, tokens), keep


def decide(
    loads: Sequence[ReplicaLoad], current: int, now: float, state: Mapping[str, Any], config: AutoscaleConfig
) -> tuple[int, dict[str, Any]]:
    """The replica count to run from ``now`` on, and the state for the next call (start with ``{}``).

    ``state`` holds when the count wanted went above (below) the current one and the least (most)
    it has wanted since; a decision, or a report that wants the current count, resets it. With
    ``smoothing_s`` it also keeps the tokens' exponential mean (``tokens``, ``tokens_at``), which
    the scale-down side reads."""
    want, keep = desired(loads, now, state, config, current)
    bounded = min(max(current, config.min_replicas), config.max_replicas)
    if bounded != current:  # outside the bounds (a changed config): move at once
        return bounded, keep
    if want > current:
        since, least = state.get("up_since", now), min(state.get("up_least", want), want)
        if now - since >= config.upscale_delay_s:
            return max(least, current + 1), keep
        return current, {"up_since": since, "up_least": least, **keep}
    if want < current:
        since, most = state.get("down_since", now), max(state.get("down_most", want), want)
        if now - since >= config.downscale_delay_s:
            return max(most, current - config.max_downscale), keep
        return current, {"down_since": since, "down_most": most, **keep}
    return current, keep


class Autoscaler:
    """:func:`decide` with its state kept, on an injected clock (the simulator's virtual one)."""

    def __init__(self, config: AutoscaleConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.state: dict[str, Any] = {}
        self.wanted = 0  # what the last reports called for before the hysteresis (a report's figure)

    def __call__(self, loads: Sequence[ReplicaLoad], current: int) -> int:
        now = self.clock()
        self.wanted = desired(loads, now, self.state, self.config, current)[0]
        target, self.state = decide(loads, current, now, self.state, self.config)
        return target


class RayAutoscalingPolicy:
    """Ray Serve's custom autoscaling policy over the replicas' ``record_autoscaling_stats``:
    ``policy_kwargs`` are :class:`AutoscaleConfig`'s fields (its bounds are the deployment's
    ``min_replicas`` / ``max_replicas``, capacity-adjusted by Ray)."""

    def __init__(self, **kwargs: Any) -> None:
        self.options = kwargs

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        config = AutoscaleConfig(
            **{
                **self.options,
                "min_replicas": ctx.capacity_adjusted_min_replicas,
                "max_replicas": max(ctx.capacity_adjusted_max_replicas, 1),
            }
        )
        loads = ray_loads(ctx.aggregated_metrics or {}, ctx.running_replicas)
        now = ctx.current_time if ctx.current_time is not None else 0.0
        return decide(loads, ctx.target_num_replicas, now, dict(ctx.policy_state or {}), config)


def ray_loads(metrics: Mapping[str, Mapping[Any, float]], replicas: Sequence[Any]) -> list[ReplicaLoad]:
    """Per running replica, its last reported (Ray-aggregated) figures; a replica that has not
    reported yet (joining) counts as empty."""
    defaults = asdict(ReplicaLoad())
    return [ReplicaLoad(**{m: float(metrics.get(m, {}).get(rid, defaults[m])) for m in METRICS}) for rid in replicas]


def autoscaling_config(config: AutoscaleConfig) -> dict[str, Any]:
    """Ray Serve's ``autoscaling_config`` for an engine deployment driven by this policy."""
    from ray.serve.config import AutoscalingPolicy

    ray_own = ("min_replicas", "max_replicas", "metrics_interval_s", "look_back_period_s")
    kwargs = {k: v for k, v in asdict(config).items() if k not in ray_own}
    return {
        "min_replicas": config.min_replicas,
        "max_replicas": config.max_replicas,
        "initial_replicas": config.min_replicas,
        "metrics_interval_s": config.metrics_interval_s,
        "look_back_period_s": config.look_back_period_s,
        # The policy keeps its own delays; Ray's would only add to them.
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": AutoscalingPolicy(policy_function=RayAutoscalingPolicy, policy_kwargs=kwargs),
    }

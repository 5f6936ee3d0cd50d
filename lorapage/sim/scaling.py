"""The fleet simulator with an autoscaler: the replica count follows :mod:`lorapage.fleet.autoscale`
(the policy Ray Serve runs) on the virtual clock.

Every ``tick_s`` the live replicas report queue depth, tokens in flight and KV headroom and the
policy decides. The seed's join sequence: a replica started at ``t`` loads the base for
``join_s``, then registers and pre-warms the adapters it now owns by the placement rule (of the
``prewarm_top`` busiest adapters lately, those whose rendezvous owners include it), and takes
traffic ``warm_s`` later. A scale-down takes replicas out of routing at once as Ray Serve picks them
(one still joining first, then the newest),
pre-warms the busy adapters it held in its pool on their next owners, and the replica drains its
requests before it stops. Replica-hours count every replica from its start to its stop (base load
and drain included).

The compute floor (:func:`floor_replica_hours`): per hour, the device-seconds its requests need
with every decode batch full (``max_num_seqs`` rows of one adapter) and every prompt prefilled once,
divided by the hour and rounded up: the fewest replicas any fixed fleet of that hour could run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from lorapage.fleet.autoscale import AutoscaleConfig, Autoscaler, ReplicaLoad
from lorapage.fleet.routing import LoadAffinityRouter, make_router, rendezvous_owners
from lorapage.sim.costs import StepShape
from lorapage.sim.fleet import SEED_SLO, Replica, SimFleetConfig, _record, _VirtualClock, to_sim_requests, ttft_summary
from lorapage.traces.records import Record
from lorapage.traces.stats import Slo
from lorapage.traces.trace import TraceRequest


@dataclass(frozen=True)
class ScalingConfig:
    """The autoscaler and the join / leave sequence on the virtual clock."""

    policy: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    tick_s: float = 1.0  # reports and decisions (Ray Serve's metrics interval)
    join_s: float = 60.0  # a new replica loads the base (a 7B base from local NVMe, CUDA graphs)
    warm_s: float = 1.0  # then pre-warms its owned adapters this long before it takes traffic
    prewarm_top: int = 500  # busiest adapters considered for a joining or inheriting owner
    traffic_half_life_s: float = 300.0  # of the adapter counts that rank them
    hour_s: float = 3600.0  # the report's hour
    initial_replicas: int | None = None  # None: min_replicas
    scale_up_window_s: float = 120.0  # requests this soon after their replica joined count as scale-up starts


@dataclass
class _Member:
    replica: Replica
    started: float
    serving_from: float  # joins routing
    leaving: bool = False
    left_at: float | None = None  # out of routing (drain starts)
    stopped: float | None = None
    prewarmed: bool = False


@dataclass
class ScaledResult:
    """One autoscaled run: records (trace order), each request's replica, the replica count over time."""

    config: SimFleetConfig
    scaling: ScalingConfig
    records: list[Record]
    replica_of: list[str]
    joined_at: dict[str, float]  # replica -> when it took traffic
    timeline: list[tuple[float, int]]  # (time, replicas started and not stopped) at every change
    replica_hours: float
    prewarms: int
    floor_hours: float  # whole replicas per hour (the target's floor)
    floor_continuous_hours: float  # device-seconds / 3,600 (fractional replicas)
    phase_hours: dict[str, float]  # replica-hours loading the base, serving, draining
    # Every tick: (time, replicas counted by the policy (joining and serving), replicas draining,
    # the count the reports called for before the hysteresis).
    ticks: list[tuple[float, int, int, int]] = field(default_factory=list)

    def hourly(self, slo: Slo = SEED_SLO) -> list[dict]:
        """Per hour of arrivals: requests, warm / cold p95 TTFT, mean replicas, whether both p95s meet ``slo``."""
        hour = self.scaling.hour_s
        by_hour: dict[int, list[Record]] = {}
        for r in self.records:
            by_hour.setdefault(int(r.scheduled_s // hour), []).append(r)
        out = []
        for h in sorted(by_hour):
            recs = by_hour[h]
            warm = ttft_summary([r for r in recs if r.tier not in slo.cold_tiers])
            cold = ttft_summary([r for r in recs if r.tier in slo.cold_tiers])
            w, c = warm["p95"], cold["p95"]
            out.append(
                {
                    "hour": h,
                    "requests": len(recs),
                    "warm_p95": w,
                    "cold_p95": c,
                    "replicas": round(self._mean_replicas(h * hour, (h + 1) * hour), 2),
                    "meets": (w is None or w <= slo.ttft_s) and (c is None or c <= slo.ttft_cold_s),
                }
            )
        return out

    def split(self) -> list[dict]:
        """Per hour, the mean replicas the policy held (``held``), the reports called for
        (``asked``) and drained (``draining``), from the ticks: ``held - asked`` is the
        hysteresis (positive: a scale-down waiting; negative: a scale-up waiting or loading)."""
        hour = self.scaling.hour_s
        sums: dict[int, list[float]] = {}
        for t, held, draining, asked in self.ticks:
            acc = sums.setdefault(int(t // hour), [0.0, 0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += held
            acc[2] += asked
            acc[3] += draining
        return [
            {
                "hour": h,
                "held": round(v[1] / v[0], 3),
                "asked": round(v[2] / v[0], 3),
                "draining": round(v[3] / v[0], 3),
            }
            for h, v in sorted(sums.items())
        ]

    def scale_up_ttft(self) -> dict[str, float | int | None]:
        """TTFT of requests that a replica took within ``scale_up_window_s`` of joining (after the first start)."""
        first = min(self.joined_at.values(), default=0.0)
        window = self.scaling.scale_up_window_s
        recs = []
        for r in self.records:
            joined = self.joined_at.get(self.replica_of[r.index])
            if joined is not None and joined > first and r.scheduled_s - joined < window:
                recs.append(r)
        return ttft_summary(recs)

    def _mean_replicas(self, t0: float, t1: float) -> float:
        area, points = 0.0, [*self.timeline, (math.inf, 0)]
        for (a, n), (b, _) in zip(points, points[1:], strict=False):
            lo, hi = max(a, t0), min(b, t1)
            if hi > lo:
                area += n * (hi - lo)
        return area / (t1 - t0)


def simulate_scaled(
    trace: Sequence[TraceRequest], config: SimFleetConfig, scaling: ScalingConfig | None = None
) -> ScaledResult:
    """Run ``trace`` through a fleet whose size the autoscaler decides; deterministic."""
    scaling = scaling or ScalingConfig()
    clock = _VirtualClock()
    router = make_router(config.router, seed=config.seed, clock=clock, **config.router_options)
    autoscaler = Autoscaler(scaling.policy, clock)
    reqs = to_sim_requests(trace, config.base_name)
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_time, i))
    members: dict[str, _Member] = {}
    alive: dict[str, _Member] = {}  # not stopped
    serial = 0
    traffic: Counter[str] = Counter()
    last_halving = 0.0
    timeline: list[tuple[float, int]] = []
    prewarms = 0
    ticks: list[tuple[float, int, int, int]] = []

    def live() -> list[_Member]:
        return list(alive.values())

    def note(now: float) -> None:
        n = len(live())
        if not timeline or timeline[-1][1] != n:
            timeline.append((now, n))

    def start(now: float, ready: bool) -> None:
        nonlocal serial
        rid = f"r{serial:03d}"
        serial += 1
        delay = 0.0 if ready else scaling.join_s + scaling.warm_s
        members[rid] = alive[rid] = _Member(Replica(rid, config), now, now + delay, prewarmed=ready)

    def routable(now: float) -> list[_Member]:
        return [m for m in live() if not m.leaving and m.serving_from <= now]

    def owners(adapter: str, ids: list[str]) -> list[str]:
        k = router.owner_count(adapter, len(ids)) if isinstance(router, LoadAffinityRouter) else 2
        return rendezvous_owners(adapter, ids, min(k, len(ids)))

    def warm(now: float, adapters: list[str], ids: list[str], only: str | None) -> None:
        nonlocal prewarms
        for adapter in adapters:
            for rid in owners(adapter, ids):
                m = members[rid]
                if (only is None or rid == only) and adapter not in m.replica.residency.snapshot()[0]:
                    m.replica.prewarm(adapter, now)
                    prewarms += 1

    def tick(now: float) -> None:
        nonlocal last_halving
        clock.now = now
        for m in live():
            m.replica.sim.run(until=now)
        if now - last_halving >= scaling.traffic_half_life_s:
            for key in list(traffic):
                traffic[key] //= 2
                if not traffic[key]:
                    del traffic[key]
            last_halving = now
        top: list[list[str]] = []

        def busy() -> list[str]:  # asked only when a replica joins or leaves
            if not top:
                top.append([a for a, _ in traffic.most_common(scaling.prewarm_top)])
            return top[0]

        for m in live():  # base loaded: register and pre-warm what it owns among the ones serving and itself
            if not m.prewarmed and now >= m.serving_from - scaling.warm_s:
                ids = [x.replica.replica_id for x in live() if not x.leaving]
                warm(now, busy(), ids, m.replica.replica_id)
                m.prewarmed = True
        for m in live():  # drained: stop
            sim = m.replica.sim
            if m.leaving and not sim.running and not sim.waiting and sim._next >= len(sim.trace):
                m.stopped = now
                del alive[m.replica.replica_id]
        counted = [m for m in live() if not m.leaving]
        loads = [_load(m.replica) for m in counted if m.serving_from <= now]
        target = autoscaler(loads, len(counted))
        ticks.append((now, len(counted), len(live()) - len(counted), autoscaler.wanted))
        for _ in range(target - len(counted)):
            start(now, ready=False)
        if target < len(counted):
            # Ray Serve's choice: replicas not yet serving first, then the newest.
            gone = sorted(counted, key=lambda m: (m.serving_from <= now, -m.started))
            for m in gone[: len(counted) - target]:
                m.leaving, m.left_at = True, now
                held = [a for a in busy() if a in m.replica.residency.snapshot()[0]]
                rest = [x.replica.replica_id for x in live() if not x.leaving]
                if rest:
                    warm(now, held, rest, None)  # its owned adapters to their next owners
        note(now)

    for _ in range(scaling.initial_replicas or max(scaling.policy.min_replicas, 1)):
        start(0.0, ready=True)
    note(0.0)
    replica_of = [""] * len(reqs)
    next_tick = 0.0
    for i in order:
        req = reqs[i]
        while next_tick <= req.arrival_time:
            tick(next_tick)
            next_tick += scaling.tick_s
        clock.now = req.arrival_time
        targets = routable(req.arrival_time) or [m for m in live() if not m.leaving] or live()
        for m in targets:
            m.replica.sim.run(until=req.arrival_time)
        by_id = {m.replica.replica_id: m for m in targets}
        chosen = router.choose(req.adapter, [m.replica.view() for m in targets])
        replica_of[i] = chosen
        by_id[chosen].replica.sim.submit(req)
        if req.adapter is not None:
            traffic[req.adapter] += 1
        if isinstance(router, LoadAffinityRouter):
            for p in router.take_prewarms():
                if p.replica_id in by_id:
                    by_id[p.replica_id].replica.prewarm(p.adapter, req.arrival_time)
                    prewarms += 1
    end = (reqs[order[-1]].arrival_time if reqs else 0.0) + config.drain_s
    last = reqs[order[-1]].arrival_time if reqs else 0.0
    for m in live():  # the run's span ends at the last arrival: what still runs then is billed to it
        m.replica.sim.run(until=end)
        m.replica.sim.settle()
        m.stopped = last
    records = [_record(i, trace[i], reqs[i]) for i in range(len(reqs))]
    hours = sum(max(min(m.stopped or last, last) - m.started, 0.0) for m in members.values()) / 3600.0
    phases = {"joining": 0.0, "serving": 0.0, "draining": 0.0}
    for m in members.values():
        stop = min(m.stopped if m.stopped is not None else last, last)
        joined = min(max(m.serving_from, m.started), stop)
        left = min(m.left_at if m.left_at is not None else stop, stop)
        phases["joining"] += (joined - m.started) / 3600.0
        phases["serving"] += max(left - joined, 0.0) / 3600.0
        phases["draining"] += max(stop - left, 0.0) / 3600.0
    timeline.append((last, 0))
    return ScaledResult(
        config=config,
        scaling=scaling,
        records=records,
        replica_of=replica_of,
        joined_at={rid: m.serving_from for rid, m in members.items()},
        timeline=timeline,
        replica_hours=hours,
        prewarms=prewarms,
        floor_hours=floor_replica_hours(trace, config, scaling.hour_s),
        floor_continuous_hours=floor_replica_hours(trace, config, scaling.hour_s, continuous=True),
        phase_hours=phases,
        ticks=ticks,
    )


def _load(replica: Replica) -> ReplicaLoad:
    sim = replica.sim
    return ReplicaLoad(len(sim.waiting), sim.tokens_in_flight, sim.kv_free)


def floor_device_seconds(trace: Sequence[TraceRequest], config: SimFleetConfig, interval_s: float) -> dict[int, float]:
    """Per interval of arrivals, the device-seconds its requests need with every decode batch full
    (``max_num_seqs`` rows of one adapter) and every prompt prefilled once."""
    costs, rows = config.costs, config.engine.max_num_seqs
    row_s = costs.time(StepShape(0, rows, [config.residency.rank])) / rows
    need: dict[int, float] = {}
    for req in to_sim_requests(trace, config.base_name):
        k = int(req.arrival_time // interval_s)
        need[k] = need.get(k, 0.0) + req.num_prompt_tokens * costs.prefill_token_s + req.max_tokens * row_s
    return need


def floor_replica_hours(
    trace: Sequence[TraceRequest], config: SimFleetConfig, hour_s: float = 3600.0, continuous: bool = False
) -> float:
    """Replica-hours of the compute floor over ``trace``'s span, in hours of 3,600 s: per hour
    ``ceil(device-seconds / hour)`` whole replicas (a fleet runs whole replicas), or with
    ``continuous`` the device-seconds themselves (fractional replicas: the lower bound)."""
    need = floor_device_seconds(trace, config, hour_s)
    if continuous:
        return sum(need.values()) / 3600.0
    return sum(math.ceil(s / hour_s) * hour_s for s in need.values()) / 3600.0

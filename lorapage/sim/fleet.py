"""The fleet simulator: K replicas, each the step simulator around the real VTC policy and the
engine's adapter residency rules (:mod:`lorapage.sim.loader`), behind one of the pure routers of
:mod:`lorapage.fleet.routing`.

Time is virtual and shared: before each arrival every replica is run up to it, the router sees
each replica's load and residency at that instant (what replicas report; here always fresh), and
the request joins the chosen replica's queue. Requests are the same traces as ``lorapage
replay``; their outputs are exactly ``max_tokens`` long. Results become replay
:class:`~lorapage.traces.records.Record` objects, so TTFT percentiles and goodput come from
:mod:`lorapage.traces.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lorapage.fleet.routing import AffinityRouter, LoadAffinityRouter, ReplicaView, Router, make_router
from lorapage.scheduler import SchedulerPolicy, VtcConfig, make_policy
from lorapage.sim.costs import GPU_7B, StepCosts
from lorapage.sim.loader import TIERS, ResidencyConfig, SimLoader
from lorapage.sim.simulator import SimConfig, SimRequest, Simulator
from lorapage.traces.records import OK, TIMEOUT, Record
from lorapage.traces.stats import Slo, percentile
from lorapage.traces.trace import TraceRequest

COLD_TIERS = ("ram", "disk", "remote")
SEED_SLO = Slo(ttft_s=1.0, ttft_cold_s=2.0, cold_tiers=COLD_TIERS)


@dataclass(frozen=True)
class SimFleetConfig:
    """One simulated fleet: replicas, their engine limits, the cost model and the router (the deployed
    fleet's configuration is :class:`lorapage.fleet.config.FleetConfig`)."""

    replicas: int = 26
    router: str = "affinity_load"  # as the deployed fleet's default (FleetConfig.router)
    router_options: dict = field(default_factory=dict)  # AffinityRouter / LoadAffinityConfig arguments
    seed: int = 0
    scheduler: str = "vtc"
    # The batch's lanes: max_loras distinct adapters (the seed's 32), its tail lanes and age deadline.
    vtc: VtcConfig = field(default_factory=VtcConfig)
    engine: SimConfig = field(default_factory=lambda: SimConfig(max_num_seqs=32, max_num_batched_tokens=8192))
    residency: ResidencyConfig = field(
        # The seed's replica: 250 GPU slots, ~385 adapters in host RAM, 1,000 on local disk (80 GB).
        default_factory=lambda: ResidencyConfig(max_resident_loras=250, max_cpu_loras=400, max_disk_loras=1000)
    )
    costs: StepCosts = GPU_7B
    warmup_s: float = 0.0  # requests arriving earlier are run but left out of the figures
    drain_s: float = 120.0  # after the last arrival, run this long; what has no first token by then timed out
    base_name: str = "base"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"a fleet needs at least one replica; got {self.replicas}")


class Replica:
    """One simulated engine: its policy, step simulator and adapter tiers."""

    def __init__(self, replica_id: str, config: SimFleetConfig) -> None:
        self.replica_id = replica_id
        self.capacity = config.engine.max_num_seqs
        # No batch holds more distinct adapters than rows, nor than are resident.
        cap = min(config.vtc.max_loras, config.residency.max_resident_loras, config.engine.max_num_seqs)
        vtc = replace(config.vtc, max_loras=cap) if cap < config.vtc.max_loras else config.vtc
        policy: SchedulerPolicy[SimRequest] = make_policy(config.scheduler, vtc=vtc)
        self.residency = SimLoader(config.residency, config.costs.loads)
        self.slots = config.residency.max_resident_loras  # adapter room, counted in (equal) adapters
        engine = SimConfig(**{**config.engine.__dict__, "cost": config.costs, "adapter_rank": config.residency.rank})
        self.sim = Simulator(policy, engine, residency=self.residency)
        self._view: tuple[tuple, ReplicaView] | None = None

    def view(self) -> ReplicaView:
        """What the replica reports: load, residency, tokens in flight, KV headroom, held adapters."""
        sim = self.sim
        key = (sim.now, len(sim.trace), sim.steps, self.residency.version)
        if self._view is not None and self._view[0] == key:
            return self._view[1]  # nothing happened here since it was last asked
        pool, host, disk = self.residency.snapshot()
        view = ReplicaView(
            self.replica_id,
            sim.in_flight,
            self.capacity,
            pool,
            host,
            disk,
            tokens_in_flight=sim.tokens_in_flight,
            kv_free=sim.kv_free,
            # Held adapter room: the slots of the distinct adapters its requests run on or wait
            # for (they cannot be evicted); there are no admin pins in a simulated run.
            pinned_bytes=sim.adapters_in_flight,
            adapter_room_bytes=self.slots,
        )
        self._view = (key, view)
        return view

    def prewarm(self, adapter: str, now: float) -> None:
        """Start loading ``adapter`` into the pool (a decode run under way stops: a load is an event)."""
        self.sim.settle()
        self.residency.prewarm(adapter, now)


@dataclass
class FleetResult:
    """A fleet run: one record per trace request (in trace order) and what each replica did."""

    config: SimFleetConfig
    records: list[Record]
    measured: list[Record]  # those arriving after the warm-up
    replica_of: list[str]  # per trace request, the replica that took it
    steps: dict[str, int]
    spills: int | None  # affinity routers only: requests sent beyond their owners
    # Device seconds stepping over replicas x seconds, from the end of the warm-up to the last
    # arrival: what binds (~1: compute). None when no request arrives after the warm-up.
    device_busy: float | None = None
    rows_per_step: float | None = None  # mean batch over the same window: how full batches were
    prewarms: int = 0  # affinity_load only: loads started on adapters' new owners

    def summary(self, slo: Slo = SEED_SLO) -> dict:
        """TTFT percentiles warm / cold / by tier, tier hit rates, SLO verdict, load spread."""
        recs = self.measured
        n = len(recs) or 1
        groups: dict[str, list[Record]] = {
            "all": recs,
            "warm": [r for r in recs if r.tier not in slo.cold_tiers],
            "cold": [r for r in recs if r.tier in slo.cold_tiers],
        }
        groups.update({t: [r for r in recs if r.tier == t] for t in (*TIERS, "none")})
        ttft = {name: ttft_summary(g) for name, g in groups.items() if g or name in ("warm", "cold")}
        warm_p95, cold_p95 = ttft["warm"]["p95"], ttft["cold"]["p95"]
        per_replica = [self.replica_of[r.index] for r in recs]
        loads = [per_replica.count(rid) for rid in sorted(set(self.replica_of))]
        return {
            "router": self.config.router,
            "replicas": self.config.replicas,
            "requests": len(recs),
            "ttft": ttft,
            "hit_rate": {t: sum(r.tier == t for r in recs) / n for t in (*TIERS, "none")},
            "timed_out": sum(r.outcome == TIMEOUT for r in recs),
            "goodput_fraction": sum(slo.met(r) for r in recs) / n,
            "meets_slo": _le(warm_p95, slo.ttft_s) and _le(cold_p95, slo.ttft_cold_s),
            "busiest_replica_share": max(loads) / n if loads else None,
            "spills": self.spills,
            "prewarms": self.prewarms,
            "steps": sum(self.steps.values()),
            "device_busy": None if self.device_busy is None else round(self.device_busy, 3),
            "rows_per_step": None if self.rows_per_step is None else round(self.rows_per_step, 2),
        }


def _le(value: float | None, target: float) -> bool:
    return value is None or value <= target  # no request of the kind: nothing missed it


def ttft_summary(records: Sequence[Record]) -> dict[str, float | int | None]:
    """Count and p50 / p95 / p99 TTFT; a request that never got a first token counts as infinite
    (a percentile that reaches one is infinite)."""
    finite = [r.ttft_s for r in records if r.ttft_s is not None]
    top = max(finite, default=0.0)
    values = finite + [math.inf] * (len(records) - len(finite))
    out: dict[str, float | int | None] = {"count": len(values)}
    for q in (50, 95, 99):
        v = percentile([min(x, top + 1.0) for x in values], q)
        out[f"p{q}"] = math.inf if v is not None and v > top else v
    return out


def adapter_of(model: str, base_name: str) -> str | None:
    """The adapter a trace's ``model`` names (``None``: the base), as the server resolves it."""
    if model == base_name:
        return None
    prefix, sep, name = model.rpartition(":")
    return name if sep and prefix == base_name else model


def to_sim_requests(trace: Sequence[TraceRequest], base_name: str) -> list[SimRequest]:
    """One :class:`SimRequest` per trace request, ``request_id`` its index."""
    out = []
    for i, req in enumerate(trace):
        prompt = req.prompt_len or len(req.prompt_ids or ()) or len(req.prompt or "")
        out.append(
            SimRequest(str(i), req.tenant, adapter_of(req.model, base_name), req.arrival_s, prompt, req.max_tokens)
        )
    return out


def _record(i: int, req: TraceRequest, sim: SimRequest) -> Record:
    ttft = None if sim.first_token_at is None else round(sim.first_token_at - sim.arrival_time, 6)
    done = sim.finished_at is not None
    return Record(
        index=i,
        tenant=req.tenant,
        model=req.model,
        tier=sim.tier,
        outcome=OK if ttft is not None else TIMEOUT,
        status=200 if ttft is not None else 0,
        scheduled_s=sim.arrival_time,
        sent_s=sim.arrival_time,
        end_s=sim.finished_at if done else None,
        ttft_s=ttft,
        e2e_s=round(sim.finished_at - sim.arrival_time, 6) if sim.finished_at is not None else None,
        prompt_tokens=sim.num_prompt_tokens,
        output_tokens=sim.generated,
        max_tokens=sim.max_tokens,
        chunks_s=[ttft] if ttft is not None else [],
    )


def simulate(trace: Sequence[TraceRequest], config: SimFleetConfig, router: Router | None = None) -> FleetResult:
    """Run ``trace`` through a fleet; deterministic for a config (and seed)."""
    replicas = [Replica(f"r{k:03d}", config) for k in range(config.replicas)]
    by_id = {r.replica_id: r for r in replicas}
    reqs = to_sim_requests(trace, config.base_name)
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_time, i))
    clock = _VirtualClock()
    router = router or make_router(config.router, seed=config.seed, clock=clock, **config.router_options)
    replica_of = [""] * len(reqs)
    prewarms = 0
    start: tuple[float, float, int, int] | None = None  # at the first measured arrival: time, busy s, rows, steps
    for i in order:
        req = reqs[i]
        clock.now = req.arrival_time
        for r in replicas:
            r.sim.run(until=req.arrival_time)
        if start is None and req.arrival_time >= config.warmup_s:
            start = (req.arrival_time, *_work(replicas))
        chosen = router.choose(req.adapter, [r.view() for r in replicas])
        replica_of[i] = chosen
        by_id[chosen].sim.submit(req)
        if isinstance(router, LoadAffinityRouter):
            for p in router.take_prewarms():
                by_id[p.replica_id].prewarm(p.adapter, req.arrival_time)
                prewarms += 1
    last = reqs[order[-1]].arrival_time if reqs else 0.0
    device_busy = None  # the devices' share of time stepping, from the warm-up's end to the last arrival
    rows_per_step = None
    if start is not None and last > start[0]:
        busy_s, rows, steps = _work(replicas)
        busy = (busy_s - start[1]) / (len(replicas) * (last - start[0]))
        rows_per_step = (rows - start[2]) / max(steps - start[3], 1)
        device_busy = min(busy, 1.0)  # a step under way at either end counts whole: a hair over 1 is 1
    horizon = last + config.drain_s
    for r in replicas:
        r.sim.run(until=horizon)
        r.sim.settle()

    records = [_record(i, trace[i], reqs[i]) for i in range(len(reqs))]
    return FleetResult(
        config=config,
        records=records,
        measured=[rec for rec in records if rec.scheduled_s >= config.warmup_s],
        replica_of=replica_of,
        steps={r.replica_id: r.sim.steps for r in replicas},
        device_busy=device_busy,
        rows_per_step=rows_per_step,
        spills=router.spills if isinstance(router, AffinityRouter | LoadAffinityRouter) else None,
        prewarms=prewarms,
    )


def _work(replicas: Sequence[Replica]) -> tuple[float, int, int]:
    """Device seconds, rows and steps of ``replicas`` so far."""
    return (
        sum(r.sim.busy_s for r in replicas),
        sum(r.sim.rows for r in replicas),
        sum(r.sim.steps for r in replicas),
    )


class _VirtualClock:
    """The simulation's time as a clock a router can be given: the current arrival's."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fewest_replicas(
    trace: Sequence[TraceRequest], config: SimFleetConfig, *, most: int, slo: Slo = SEED_SLO
) -> int | None:
    """The fewest replicas (1..``most``) meeting ``slo`` for ``config``'s router, by bisection
    (assumes more replicas never hurt); ``None`` when even ``most`` does not."""
    from dataclasses import replace

    def ok(k: int) -> bool:
        return bool(simulate(trace, replace(config, replicas=k)).summary(slo)["meets_slo"])

    if not ok(most):
        return None
    lo, hi = 0, most  # ok(hi) holds; ok(lo) does not (0 replicas serve nothing)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi

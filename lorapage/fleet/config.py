"""``FleetConfig``: everything fixed when a fleet starts, frozen and picklable (it travels to Ray)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorapage.config import EngineConfig
from lorapage.fleet.autoscale import AutoscaleConfig
from lorapage.fleet.promotion import DedicatedConfig
from lorapage.frontend.edge import EdgeLimits
from lorapage.sources import AdapterRoots
from lorapage.tenancy.slo import DEFAULT_WINDOW_S

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # as `lorapage serve`
APP_NAME = "lorapage"
ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "FleetIngress"
MERGED_APP_PREFIX = f"{APP_NAME}-merged-"  # + adapter id: a promoted adapter's dedicated deployment (its own app)
INGRESS_CPUS = 0.5
MIN_REPLICA_CPUS = 0.1  # below this an engine replica's share of a core is no use


@dataclass(frozen=True)
class FleetConfig:
    """One ingress replica in front of ``replicas`` engine replicas, each one :class:`~lorapage.Engine`.

    The tenants file travels as its TOML text, so every Ray node sees the same one whatever its
    disk holds. ``owners`` and ``spill_load`` are the :class:`~lorapage.fleet.routing.AffinityRouter`
    options; ``max_ongoing_requests`` is Ray's hard cap per engine replica (requests past it wait in
    the ingress's router), and replicas report residency every ``routing_stats_period_s``.
    """

    engine: EngineConfig
    tenants_toml: str
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, directory), registered on every replica
    replicas: int = 2
    replica_cpus: float = 1.0  # per tensor-parallel rank (one rank: per replica)
    replica_gpus: float = 0.0  # per tensor-parallel rank
    ingress_cpus: float = INGRESS_CPUS
    router: str = "affinity_load"  # a name of lorapage.fleet.routing.ROUTERS (issue 42: the default; "affinity" stays)
    owners: int = 2
    spill_load: float = 1.0
    pinned_guard: float = 0.8  # affinity_load: held share of a replica's lora slots past which no new adapter comes
    autoscale: AutoscaleConfig | None = None  # None: a fixed ``replicas``; else ``replicas`` is its min_replicas
    max_ongoing_requests: int = 256
    routing_stats_period_s: float = 1.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_retries: int = 3  # resubmissions of a request whose replica died before it answered
    state_dir: str | None = None  # the fleet's adapter registry, on the ingress's node (None: in memory)
    adapter_roots: tuple[str, ...] = ()  # --adapter-root values, DIR or TENANT=DIR (none: directories refused)
    metrics_public: bool = False  # /metrics without a key
    sync_period_s: float = 1.0  # replica heartbeats: registry changes, stats and series
    slo_window_s: float = DEFAULT_WINDOW_S  # each tenant's goodput and burn-rate window (--slo-window)
    access_log: str | None = None  # --access-log FILE (on the ingress's node) or "-" (its stdout); None: off
    dedicated: DedicatedConfig = DedicatedConfig()  # merged deployments of promoted adapters (lorapage.fleet.dedicated)
    bases: tuple[str, ...] = ()  # --base DIRs: one more engine deployment each, ``replicas`` replicas (fleet/bases.py)
    host: str = "127.0.0.1"  # where the ingress listens (on the node Ray places it on)
    port: int = 8000
    edge: EdgeLimits = EdgeLimits()  # the ingress's connection-level bounds (--header-timeout, ...)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1; got {self.replicas}")
        if (
            self.max_ongoing_requests < 1
            or self.routing_stats_period_s <= 0
            or self.request_retries < 0
            or self.sync_period_s <= 0
            or not 0 < self.slo_window_s < math.inf
        ):
            raise ValueError(
                "max_ongoing_requests must be >= 1, routing_stats_period_s > 0, request_retries >= 0, "
                f"sync_period_s > 0 and slo_window_s > 0; got {self.max_ongoing_requests}, "
                f"{self.routing_stats_period_s}, {self.request_retries}, {self.sync_period_s}, {self.slo_window_s}"
            )

    def max_replicas(self) -> int:
        """Engine replicas at most: ``replicas``, or the autoscaler's maximum."""
        return self.replicas if self.autoscale is None else max(self.replicas, self.autoscale.max_replicas)

    def roots(self) -> AdapterRoots:
        """The adapter roots, at registration and at every load; ``lora_modules`` are the operator's."""
        return AdapterRoots.parse(self.adapter_roots, operator=[path for _, path in self.lora_modules])

    def replica_needs(self) -> dict[str, dict[str, float]]:
        """What one replica of each deployment reserves from Ray (every rank's bundle together)."""
        k = self.engine.tensor_parallel_size
        engine = {"CPU": self.replica_cpus * k, "GPU": self.replica_gpus * k}
        sides = {base_deployment(model): engine for model in self.bases}
        return {ENGINE_DEPLOYMENT: engine, **sides, INGRESS_DEPLOYMENT: {"CPU": self.ingress_cpus}}

    def engine_options(self, engine: EngineConfig) -> dict[str, Any]:
        """Ray Serve deployment options that place one replica of ``engine``.

        One rank: the actor's CPUs and GPUs. ``k`` tensor-parallel ranks: a placement group of
        ``k`` bundles on one node (``STRICT_PACK``), one per rank, each ``replica_cpus`` CPUs.
        The ranks are the replica's own child processes (not Ray actors), so they see only the
        GPUs Ray made visible to the replica: its bundle, the first (where Ray Serve puts the
        replica's actor), holds the ``k`` GPUs (``cuda:0..k-1`` to the ranks), and the others the
        CPUs of ranks 1..k-1."""
        k = engine.tensor_parallel_size
        actor = {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus * k}
        if k == 1:
            return {"ray_actor_options": actor}
        first = _bundle(self.replica_cpus, self.replica_gpus * k)
        return {
            "ray_actor_options": actor,
            "placement_group_bundles": [first] + [_bundle(self.replica_cpus, 0.0) for _ in range(k - 1)],
            "placement_group_strategy": "STRICT_PACK",
        }

    def router_options(self) -> dict[str, object]:
        """Keyword options for :func:`~lorapage.fleet.routing.make_router`."""
        if self.router == "affinity":
            return {"owners": self.owners, "spill_load": self.spill_load}
        if self.router == "affinity_load":  # --owners is its fewest owners; more follow traffic
            return {
                "min_owners": self.owners,
                "max_owners": max(self.owners, 8),
                "spill_load": self.spill_load,
                "pinned_guard": self.pinned_guard,
            }
        return {}


def base_deployment(model: str) -> str:
    """The name of the engine deployment serving base ``model`` beside the primary's (``--base``)."""
    return f"{ENGINE_DEPLOYMENT}-{Path(model).name}"


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    """A placement-group bundle (Ray refuses a resource of 0 in one)."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def replica_cpus_for(cpus: float, replicas: int, ingress_cpus: float, wanted: float | None, ranks: int = 1) -> float:
    """CPUs to reserve per engine replica (per tensor-parallel rank of one, when ``ranks`` > 1) on
    a cluster of ``cpus`` CPUs so that ``replicas`` of them and the ingress fit: ``wanted`` when
    given and it fits, else as much as fits up to one each. Raises ValueError with the arithmetic
    and the flags to change when nothing fits."""
    room, units = cpus - ingress_cpus, replicas * ranks
    each = "replica" if ranks == 1 else f"rank ({ranks} per replica, --tensor-parallel-size)"
    if wanted is None:
        share = math.floor(min(1.0, room / units) * 1000) / 1000  # rounded down: the sum must fit
        if share >= MIN_REPLICA_CPUS:
            return share
        raise ValueError(
            f"{replicas} engine replicas and the ingress ({ingress_cpus} CPU) do not fit in {cpus:g} CPUs: each "
            f"{each} would get {room / units:.3f} CPU (< {MIN_REPLICA_CPUS}); pass fewer --replicas, or more "
            "--num-cpus (a local Ray) / a bigger cluster"
        )
    if units * wanted + ingress_cpus > cpus:
        ranks_x = "" if ranks == 1 else f" x {ranks} ranks"
        raise ValueError(
            f"--replica-cpus {wanted:g} x {replicas} replicas{ranks_x} + {ingress_cpus} for the ingress = "
            f"{units * wanted + ingress_cpus:g} CPUs, but Ray has {cpus:g}: Ray would never schedule them all. "
            f"Pass --replica-cpus {room / units:.2f} or less, fewer --replicas, or more --num-cpus"
        )
    return wanted

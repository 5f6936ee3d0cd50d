"""``FleetConfig``: everything fixed when a fleet starts, frozen and picklable (it travels to Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from lorapage.config import EngineConfig

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # as `lorapage serve`
APP_NAME = "lorapage"
ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "FleetIngress"


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
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    ingress_cpus: float = 0.5
    router: str = "affinity"  # a name of lorapage.fleet.routing.ROUTERS
    owners: int = 2
    spill_load: float = 1.0
    max_ongoing_requests: int = 256
    routing_stats_period_s: float = 1.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_retries: int = 3  # resubmissions of a request whose replica died before it answered
    state_dir: str | None = None  # the fleet's adapter registry, on the ingress's node (None: in memory)
    adapter_roots: tuple[str, ...] = ()  # directories POST /v1/adapters may read (none: refused)
    metrics_public: bool = False  # /metrics without a key
    sync_period_s: float = 1.0  # replica heartbeats: registry changes, stats and series

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1; got {self.replicas}")
        if (
            self.max_ongoing_requests < 1
            or self.routing_stats_period_s <= 0
            or self.request_retries < 0
            or self.sync_period_s <= 0
        ):
            raise ValueError(
                "max_ongoing_requests must be >= 1, routing_stats_period_s > 0, request_retries >= 0 and "
                f"sync_period_s > 0; got {self.max_ongoing_requests}, {self.routing_stats_period_s}, "
                f"{self.request_retries}, {self.sync_period_s}"
            )

    def router_options(self) -> dict[str, object]:
        """Keyword options for :func:`~lorapage.fleet.routing.make_router`."""
        if self.router == "affinity":
            return {"owners": self.owners, "spill_load": self.spill_load}
        return {}

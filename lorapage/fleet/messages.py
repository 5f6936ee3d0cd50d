"""What the ingress and the engine replicas send each other over Ray: plain picklable records.

Kept free of Ray imports so the records (and their tests) load without the ``[fleet]`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from lorapage.adapters.tiers import TierState
from lorapage.engine.stats import EngineStats
from lorapage.errors import LorapageError
from lorapage.registry.store import VersionRow
from lorapage.sampling_params import SamplingParams
from lorapage.usage.ledger import Traffic, TrafficKey

T = TypeVar("T")


def answered(got: T | LorapageError) -> T:
    """A replica's answer, or the refusal it returned (replicas return their refusals: a raised
    one would reach the caller as Ray's error, not the 4xx it is) raised here."""
    if isinstance(got, LorapageError):
        raise got
    return got


@dataclass(frozen=True)
class EngineJob:
    """One request for an engine replica: its prompt already tokenized and checked by the ingress."""

    prompt: list[int]
    adapter: str | None
    sampling: SamplingParams
    tenant: str
    request_id: str  # the engine's id: made by the ingress, never a client's
    prefix_group: str | None = None  # whose cached prompt prefixes it shares (None: its tenant's only)


@dataclass(frozen=True)
class ReplicaStart:
    """The first item of every replica stream: which replica (Ray's replica id) took the request,
    and the adapter version (``N`` of ``id@N``) it resolved the request to (None: the base)."""

    replica_id: str
    adapter_version: int | None = None


@dataclass(frozen=True)
class EngineProfile:
    """What the ingress needs to know of the engines before it can check a request."""

    base_name: str
    max_model_len: int
    vocab_size: int
    base_digest: str  # what every adapter version must have been validated against


@dataclass(frozen=True)
class IdState:
    """One adapter id as the fleet's registry holds it: what a replica mirrors (no versions: the
    id is gone)."""

    adapter_id: str
    owner: str | None
    current: int | None
    versions: tuple[VersionRow, ...]


@dataclass(frozen=True)
class Heartbeat:
    """What an engine replica tells the ingress every ``sync_period_s``: the registry generation
    it has mirrored (0: none yet), its ``Engine.stats()`` and its engine series (Prometheus text),
    and its traffic counts since its last heartbeat (:mod:`lorapage.fleet.traffic`)."""

    replica_id: str
    epoch: str  # the ingress process the generation counts in ("" before the first reply)
    generation: int
    stats: EngineStats
    metrics: bytes
    base_digest: str = ""  # the base its engine runs: which deployment it is (--base, lorapage.fleet.bases)
    traffic: dict[TrafficKey, Traffic] = field(default_factory=dict)  # requests and tokens per (hour, version)
    tiers_judged: int = 0  # the ingress's tier judgement it carries out (0: none yet)


@dataclass(frozen=True)
class SyncReply:
    """The ingress's answer: the ids changed since the replica's generation (``full``: every id,
    and any other the replica holds is gone), admin unloads since then, the VTC shares, and the
    pre-warms the request router asked of this replica (:mod:`lorapage.fleet.prewarm`), and the
    fleet's traffic tiers when judged since the replica's last (:mod:`lorapage.fleet.traffic`)."""

    epoch: str
    generation: int
    full: bool
    ids: tuple[IdState, ...]
    unloads: tuple[str, ...]
    tenant_weights: dict[str, float]
    prewarms: tuple[str, ...] = ()  # versions the router made this replica an owner of: load them
    tiers: dict[str, TierState] | None = None  # the fleet's traffic tiers, when newer than the replica's
    tiers_judged: int = 0  # which judgement ``tiers`` is

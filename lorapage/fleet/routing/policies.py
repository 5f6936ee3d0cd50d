"""The routing policies by request count: random, least-loaded, affinity, Ray's default.

A router sees only :class:`ReplicaView` snapshots (load and residency each replica reported) and
the request's adapter; it owns no clock, no Ray handle and no I/O, so the Ray Serve request router
and ``lorapage.sim.fleet`` call the very same ``choose``. Randomised routers take a seed; the
affinity router's memory of temporary owners ages in *number of choices*, not seconds, so the same
sequence of calls always gives the same answers.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

# A call for one replica by id (the ingress gathering every replica's usage) names it so in place
# of an adapter; adapter ids never hold ':'.
REPLICA_TARGET = "replica:"


def replica_target(replica_id: str) -> str:
    """The routing key that sends a call to replica ``replica_id`` only."""
    return REPLICA_TARGET + replica_id


def targeted_replica(key: str) -> str | None:
    """The replica id a :func:`replica_target` key names; None for an adapter (or the base)."""
    return key.removeprefix(REPLICA_TARGET) if key.startswith(REPLICA_TARGET) else None


@dataclass(frozen=True)
class ReplicaView:
    """What a router knows of one replica at the moment it chooses."""

    replica_id: str
    in_flight: int  # requests running or queued on it
    capacity: int  # in_flight at which it counts as saturated (e.g. max_num_seqs)
    pool: frozenset[str] = frozenset()  # adapters resident in its page pool
    host: frozenset[str] = frozenset()  # adapters in its host RAM
    disk: frozenset[str] = frozenset()  # adapters in its local disk cache
    # The load that matters (``affinity_load``): prompt + remaining output tokens of the requests
    # running or queued; the fraction of KV pages free; adapter bytes that cannot be evicted now
    # (pinned, kept hot, or with requests) and the bytes its pool can give adapters (0: unknown).
    tokens_in_flight: int = 0
    kv_free: float = 1.0
    pinned_bytes: int = 0
    adapter_room_bytes: int = 0
    # The same in lora slots: a slot is sized for an adapter of max_lora_rank on every module, so
    # slots full of smaller held adapters leave bytes but no slot (0: unknown).
    held_slots: int = 0
    slots: int = 0

    @property
    def load(self) -> float:
        """In-flight requests as a fraction of capacity (1.0 = saturated)."""
        return self.in_flight / max(self.capacity, 1)

    @property
    def pinned_fraction(self) -> float:
        """Held adapter bytes over the adapter room, or held lora slots over the slots, whichever
        is more (0 when both are unknown)."""
        by_bytes = self.pinned_bytes / self.adapter_room_bytes if self.adapter_room_bytes > 0 else 0.0
        return max(by_bytes, self.held_slots / self.slots if self.slots > 0 else 0.0)


class Router(Protocol):
    """Chooses a replica for one request."""

    name: str

    def choose(self, adapter: str | None, replicas: Sequence[ReplicaView]) -> str:
        """The ``replica_id`` of the replica (one of ``replicas``, never empty) that takes it."""
        ...


@lru_cache(maxsize=1 << 16)  # pure: a fleet asks the same pairs at every request
def _weight(adapter: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{adapter}|{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_owners(adapter: str, replica_ids: Sequence[str], k: int) -> list[str]:
    """The ``k`` replicas with the highest random weight for ``adapter``, highest first.

    Highest-random-weight hashing: each (adapter, replica) pair gets a stable 64-bit weight
    (blake2b, independent of the process and of ``PYTHONHASHSEED``). A replica that leaves moves
    only the adapters it owned; one that joins takes about ``k/len(replica_ids)`` of them.
    """
    ranked = sorted(replica_ids, key=lambda rid: (_weight(adapter, rid), rid), reverse=True)
    return ranked[: max(k, 0)]


def _check(replicas: Sequence[ReplicaView]) -> None:
    if not replicas:
        raise ValueError("no replica to route to: the fleet has no live replica")


def _least_loaded(replicas: Sequence[ReplicaView]) -> ReplicaView:
    return min(replicas, key=lambda r: (r.load, r.replica_id))


class RandomRouter:
    """Uniform over live replicas: the baseline every adapter-aware policy must beat."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, adapter: str | None, replicas: Sequence[ReplicaView]) -> str:
        _check(replicas)
        return replicas[self._rng.randrange(len(replicas))].replica_id


class LeastLoadedRouter:
    """The replica with the lowest ``in_flight / capacity`` (ties: lowest ``replica_id``)."""

    name = "least_loaded"

    def choose(self, adapter: str | None, replicas: Sequence[ReplicaView]) -> str:
        _check(replicas)
        return _least_loaded(replicas).replica_id


@dataclass(frozen=True)
class ResidencyBonus:
    """How much busier (as a fraction of capacity) a replica holding the adapter may be and still
    be preferred: a pool hit saves a host->GPU copy, a host hit a disk read, a disk hit a fetch."""

    pool: float = 0.25
    host: float = 0.10
    disk: float = 0.05

    def of(self, adapter: str, replica: ReplicaView) -> float:
        if adapter in replica.pool:
            return self.pool
        if adapter in replica.host:
            return self.host
        if adapter in replica.disk:
            return self.disk
        return 0.0


class AffinityRouter:
    """Rendezvous owners per adapter, least-loaded owner, bounded-load spill, residency-aware.

    Candidates for an adapter are its ``owners`` rendezvous owners among the live replicas plus its
    live temporary owners. Among candidates below ``spill_load * capacity`` it takes the one with
    the lowest ``load - bonus(tier)`` (see :class:`ResidencyBonus`; ties by ``replica_id``). When
    every candidate is at or over that bound, the request spills to the replica with the lowest
    ``load - bonus`` over the whole fleet, which becomes a temporary owner.

    Temporary owners are remembered per adapter in an LRU of at most ``max_temp_owners`` replicas;
    each expires ``temp_ttl`` choices (of this router, any adapter) after it last took a request
    for that adapter, and at most ``max_tracked`` adapters keep any (least recently spilled are
    forgotten first). So the memory is bounded and a burst's extra owners fade once it passes.
    """

    name = "affinity"

    def __init__(
        self,
        owners: int = 2,
        spill_load: float = 1.0,
        residency_bonus: ResidencyBonus | None = None,
        max_temp_owners: int = 2,
        temp_ttl: int = 10_000,
        max_tracked: int = 10_000,
    ) -> None:
        if owners < 1 or spill_load <= 0 or max_temp_owners < 0 or temp_ttl < 1 or max_tracked < 1:
            raise ValueError(
                "AffinityRouter needs owners >= 1, spill_load > 0, max_temp_owners >= 0, temp_ttl >= 1 "
                f"and max_tracked >= 1; got {owners}, {spill_load}, {max_temp_owners}, {temp_ttl}, {max_tracked}"
            )
        self.owners = owners
        self.spill_load = spill_load
        self.bonus = residency_bonus or ResidencyBonus()
        self.max_temp_owners = max_temp_owners
        self.temp_ttl = temp_ttl
        self.max_tracked = max_tracked
        self._choices = 0  # this router's clock: choices made so far
        # adapter -> (replica_id -> choice count when it last served as temporary owner), LRU order
        self._temp: OrderedDict[str, OrderedDict[str, int]] = OrderedDict()
        self.spills = 0  # requests that went beyond their candidates

    def choose(self, adapter: str | None, replicas: Sequence[ReplicaView]) -> str:
        _check(replicas)
        self._choices += 1
        if adapter is None:
            return _least_loaded(replicas).replica_id
        by_id = {r.replica_id: r for r in replicas}
        candidates = self.candidates(adapter, list(by_id))
        below = [by_id[rid] for rid in candidates if by_id[rid].load < self.spill_load]
        if below:
            chosen = self._best(adapter, below)
            if chosen.replica_id in self._temp.get(adapter, ()):
                self._remember(adapter, chosen.replica_id)
            return chosen.replica_id
        chosen = self._best(adapter, replicas)
        self.spills += 1
        if chosen.replica_id not in candidates[: self.owners]:
            self._remember(adapter, chosen.replica_id)
        return chosen.replica_id

    def candidates(self, adapter: str, replica_ids: Sequence[str]) -> list[str]:
        """Live owners of ``adapter`` (rendezvous first, then unexpired temporary ones)."""
        owners = rendezvous_owners(adapter, replica_ids, self.owners)
        temp = self._temp.get(adapter)
        if not temp:
            return owners
        live = set(replica_ids)
        for rid, last in list(temp.items()):
            if self._choices - last > self.temp_ttl:
                del temp[rid]
            elif rid in live and rid not in owners:
                owners.append(rid)
        if not temp:
            del self._temp[adapter]
        return owners

    def temporary_owners(self, adapter: str) -> list[str]:
        """The temporary owners ``adapter`` has now (expired ones included until next looked at)."""
        return list(self._temp.get(adapter, ()))

    def _best(self, adapter: str, replicas: Sequence[ReplicaView]) -> ReplicaView:
        return min(replicas, key=lambda r: (r.load - self.bonus.of(adapter, r), r.replica_id))

    def _remember(self, adapter: str, replica_id: str) -> None:
        if self.max_temp_owners == 0:
            return
        temp = self._temp.setdefault(adapter, OrderedDict())
        self._temp.move_to_end(adapter)
        temp[replica_id] = self._choices
        temp.move_to_end(replica_id)
        while len(temp) > self.max_temp_owners:
            temp.popitem(last=False)
        while len(self._temp) > self.max_tracked:
            self._temp.popitem(last=False)


class RayDefaultRouter:
    """What Ray Serve's default router (``PowerOfTwoChoicesRequestRouter``) does on its own.

    Our model of it, from ``python/ray/serve/_private/request_router/`` (pow_2_router.py and the
    ``MultiplexMixin`` in request_router.py): for a multiplexed model id, the candidates are the
    replicas reporting that model loaded; if none does, the replicas with the fewest models loaded;
    then every replica. From the candidates it samples two at random and takes the one with the
    shorter queue among those that accept (``in_flight < capacity``, Ray's
    ``max_ongoing_requests``). If neither accepts it moves to the next candidate set. Ray would
    then back off and retry until a replica accepts; with no clock here, the request goes to the
    shorter queue of two random replicas instead (it queues there). Ray's 1 s matching timeout and
    its once-per-model fallback set are not modelled: every choice is one pass.

    A replica's "loaded models" are the adapters in its pool or host RAM (Ray's multiplexed LRU
    lives in the replica process, which is what host RAM is); ``disk`` is ignored, as Ray sees
    only model ids a replica reports loaded. Requests without an adapter use plain power of two.
    """

    name = "ray_default"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, adapter: str | None, replicas: Sequence[ReplicaView]) -> str:
        _check(replicas)
        for tier in self._tiers(adapter, replicas):
            pick = self._two_choices(tier, accepting_only=True)
            if pick is not None:
                return pick.replica_id
        pick = self._two_choices(replicas, accepting_only=False)
        assert pick is not None
        return pick.replica_id

    def _tiers(self, adapter: str | None, replicas: Sequence[ReplicaView]) -> list[Sequence[ReplicaView]]:
        if adapter is None:
            return [replicas]
        loaded = [r for r in replicas if adapter in r.pool or adapter in r.host]
        fewest = min(len(r.pool | r.host) for r in replicas)
        least = [r for r in replicas if len(r.pool | r.host) == fewest]
        return [t for t in (loaded, least, replicas) if t]

    def _two_choices(self, replicas: Sequence[ReplicaView], *, accepting_only: bool) -> ReplicaView | None:
        if len(replicas) == 1:
            pair = [replicas[0]]
        else:
            i = self._rng.randrange(len(replicas))
            j = self._rng.randrange(len(replicas) - 1)
            pair = [replicas[i], replicas[j + (j >= i)]]
        if accepting_only:
            pair = [r for r in pair if r.in_flight < r.capacity]
        return min(pair, key=lambda r: r.in_flight) if pair else None

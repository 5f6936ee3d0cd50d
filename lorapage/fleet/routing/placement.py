"""Placement by the load that matters: the ``affinity_load`` router.

Like ``affinity`` (:mod:`lorapage.fleet.routing.policies`) an adapter's requests go to its rendezvous
owners, but:

- **the owner count follows traffic**: each adapter's recent request rate is a decaying counter
  (half-life ``half_life_s`` on the injected clock), and its owners are the top
  ``k = clamp(ceil(share x replicas x owner_factor), min_owners, max_owners)`` of rendezvous
  hashing, ``share`` being its rate over the fleet's (the denominator at least ``min_total``, so
  the first requests of a run do not look like a hot adapter's). A hot adapter spreads over more
  replicas; once its traffic fades, its owner count shrinks back;
- **owners are judged by tokens, not requests**: among owners under the bound, the one with the
  fewest ``tokens_in_flight`` (prompt + remaining output of what it runs and queues) after a
  residency bonus in tokens (pool > host RAM > disk); a replica is over the bound when its requests
  reach ``spill_load x capacity`` or its KV headroom is below ``kv_reserve``;
- **spill**: when every owner is over the bound, the replica of the whole fleet (full ones too)
  with the lowest ``load - spill_bonus`` (requests over capacity, less a residency bonus as a
  fraction of capacity: ``affinity``'s rule), which becomes one of the adapter's ``spill_owners``
  extra owners until ``spill_ttl_s`` pass without a request of the adapter going there;
- **a pinned-bytes guard**: a replica whose adapter room is at least ``pinned_guard`` held by
  adapters that cannot be evicted (pinned, kept hot, or with requests) takes no adapter it does
  not already hold (pool or host RAM), unless every replica is so guarded;
- **pre-warming**: when an adapter's owner count grows, each new owner not holding it is named in
  a :class:`Prewarm`; the caller takes them with :meth:`LoadAffinityRouter.take_prewarms` and has
  the replica load the adapter (the fleet: ``Engine.load_adapter``; the simulator: a load on its
  virtual clock).

Why spills go where ``affinity``'s go (issue 42). The first version spilled to the next two replicas
of the adapter's ranking that were *under* the bound, weighed by tokens, and kept no memory of
them. On the seed trace at 18 replicas of 32 rows (the compute floor: every device busy all the
time) that spilled 1,177 requests against ``affinity``'s 539, with 78% pool hits against 85% and a
warm p99 of 3.6 s against 1.5 s. Three causes, each measured in the simulator: (1) with no memory,
every later request of an adapter whose owners stay full spills again, where ``affinity`` counts
a request sent to a replica it spilled to before (a temporary owner) as no spill: spill owners
alone brought the count to 633; (2) only open replicas could take a spill, and at the floor the
open ones rarely hold the adapter, so spills became cold loads that also evicted other adapters:
letting a full replica that holds it take the spill (its queue beats a fetch) gave back the pool
hits (85%); (3) among replicas past the bound, tokens in flight do not say how long a new request
waits for a row (the requests ahead of it do): judging spills by requests, as ``affinity`` does,
brought warm p95 from 1.39 s to 0.84 s (``affinity``: 0.89 s). Owners under the bound are still
judged by tokens. ``kv_reserve`` went from 5% to 2%: at 64 rows the seed's KV is about full, and
5% (about four seed requests' pages) made owners with room count as full (519 of 696 spills at 13
replicas). Figures for every size: docs/fleet.md.

The router is pure: no I/O, no Ray, time only from the clock it is given.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lorapage.fleet.routing.policies import ReplicaView, ResidencyBonus, rendezvous_owners


@dataclass(frozen=True)
class Prewarm:
    """Load ``adapter`` on ``replica_id`` ahead of its requests: it just became one of its owners."""

    adapter: str
    replica_id: str


def _token_bonus() -> ResidencyBonus:
    # Tokens a replica holding the adapter may have in flight beyond another's and still win:
    # affinity's bonus (0.25 / 0.10 / 0.05 of 32 requests) at ~1,000 tokens a request (the seed's
    # 750 prompt + 250 output). Smaller bonuses (1,500 / 400 / 300) lost pool hits in the simulator.
    return ResidencyBonus(pool=8000.0, host=3000.0, disk=1500.0)


@dataclass(frozen=True)
class LoadAffinityConfig:
    """The ``affinity_load`` router's knobs (see the module docstring)."""

    min_owners: int = 2
    max_owners: int = 8
    owner_factor: float = 1.0
    half_life_s: float = 30.0
    min_total: float = 100.0  # decayed requests the share's denominator is at least
    spill_load: float = 1.0  # requests in flight / capacity at which an owner counts as full
    kv_reserve: float = 0.02  # KV headroom below which an owner counts as full (about one seed request)
    spill_owners: int = 2  # replicas an adapter's spills went to, kept as its extra owners (0: none)
    spill_ttl_s: float = 120.0  # a spill owner stays one this long after its last request of the adapter
    spill_bonus: ResidencyBonus = field(default_factory=ResidencyBonus)  # fractions of capacity, as affinity's
    pinned_guard: float = 0.8  # held fraction of adapter room past which no new adapters come
    bonus: ResidencyBonus = field(default_factory=_token_bonus)  # in tokens
    max_tracked: int = 10_000  # adapters whose rate and owner count are remembered

    def __post_init__(self) -> None:
        if not 1 <= self.min_owners <= self.max_owners:
            raise ValueError(f"need 1 <= min_owners <= max_owners; got {self.min_owners}, {self.max_owners}")
        if min(self.owner_factor, self.half_life_s, self.min_total, self.spill_load, self.spill_ttl_s) <= 0:
            raise ValueError("owner_factor, half_life_s, min_total, spill_load and spill_ttl_s must be positive")
        if self.spill_owners < 0:
            raise ValueError(f"spill_owners must be >= 0; got {self.spill_owners}")
        if not 0 <= self.kv_reserve < 1 or not 0 < self.pinned_guard <= 1 or self.max_tracked < 1:
            raise ValueError(
                f"need 0 <= kv_reserve < 1, 0 < pinned_guard <= 1 and max_tracked >= 1; "
                f"got {self.kv_reserve}, {self.pinned_guard}, {self.max_tracked}"
            )


class DecayingCounts:
    """Request rates per key and in total, each an exponentially decaying count (half-life in the
    clock's seconds), at most ``max_keys`` keys (least recently counted forgotten first)."""

    def __init__(self, half_life_s: float, max_keys: int) -> None:
        self._rate = math.log(2) / half_life_s
        self.max_keys = max_keys
        self._keys: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (count, as of)
        self._total = (0.0, 0.0)

    def _decayed(self, value: tuple[float, float], now: float) -> float:
        count, at = value
        return count * math.exp(-self._rate * max(now - at, 0.0))

    def add(self, key: str, now: float, weight: float = 1.0) -> None:
        """One request (or ``weight``: tokens, say) for ``key`` at ``now``."""
        self._keys[key] = (self._decayed(self._keys.get(key, (0.0, now)), now) + weight, now)
        self._keys.move_to_end(key)
        self._total = (self._decayed(self._total, now) + weight, now)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def count(self, key: str, now: float) -> float:
        """``key``'s decayed count at ``now`` (0 for a key never counted or forgotten)."""
        value = self._keys.get(key)
        return 0.0 if value is None else self._decayed(value, now)

    def total(self, now: float) -> float:
        return self._decayed(self._total, now)

    def rate(self, key: str, now: float) -> float:
        """``key``'s rate per second at ``now``: a steady rate ``r`` decays to a count of ``r / (ln 2 / half-life)``."""
        return self.count(key, now) * self._rate

    def keys(self) -> list[str]:
        """The keys remembered, least recently counted first."""
        return list(self._keys)


class LoadAffinityRouter:
    """Rendezvous owners, as many as an adapter's share of traffic needs, judged by tokens in
    flight and KV headroom, with a pinned-bytes guard and pre-warming (module docstring)."""

    name = "affinity_load"

    def __init__(self, clock: Callable[[], float], config: LoadAffinityConfig | None = None) -> None:
        self.clock = clock
        self.config = config or LoadAffinityConfig()
        self.counts = DecayingCounts(self.config.half_life_s, self.config.max_tracked)
        self._owners: OrderedDict[str, int] = OrderedDict()  # adapter -> owner count at its last request
        self._prewarms: list[Prewarm] = []
        self._spill_owners: OrderedDict[str, OrderedDict[str, float]] = OrderedDict()  # adapter -> replica -> last
        self.spills = 0  # requests sent beyond their owners
        self.guarded = 0  # choices where the guard turned a replica away

    # -- what callers use -------------------------------------------------------------------------

    def choose(self, adapter: str | None, replicas: Sequence[ReplicaView]) -> str:
        """The replica for one request (see the class docstring)."""
        if not replicas:
            raise ValueError("no replica to route to: the fleet has no live replica")
        if adapter is None:
            return self._least_tokens(replicas).replica_id
        now = self.clock()
        self.counts.add(adapter, now)
        by_id = {r.replica_id: r for r in replicas}
        ranked = rendezvous_owners(adapter, list(by_id), len(by_id))
        k = self._owner_count(adapter, ranked, by_id)
        admissible = self._guard(adapter, replicas)
        allowed = {r.replica_id for r in admissible}
        owners = [*ranked[:k], *self.spill_owners(adapter, list(by_id))]
        under = [by_id[rid] for rid in owners if rid in allowed and self._under(by_id[rid])]
        if under:
            bonus = self.config.bonus.of
            chosen = min(under, key=lambda r: (r.tokens_in_flight - bonus(adapter, r), r.replica_id)).replica_id
        else:
            # Every owner is past the bound: the request will most likely wait for a batch row
            # wherever it goes, and that wait is set by the requests ahead of it, not by their
            # tokens. So, as ``affinity``, the fleet's lowest ``load - bonus``, full replicas too: one
            # holding the adapter in its pool may be a quarter of its rows busier and still win.
            self.spills += 1
            spill_bonus = self.config.spill_bonus.of
            chosen = min(admissible, key=lambda r: (r.load - spill_bonus(adapter, r), r.replica_id)).replica_id
        if (not under and chosen not in ranked[:k]) or chosen in self._spill_owners.get(adapter, ()):
            self._remember_spill(adapter, chosen, now)
        return chosen

    def owners(self, adapter: str, replica_ids: Sequence[str]) -> list[str]:
        """``adapter``'s owners now (rendezvous order), without counting a request."""
        return rendezvous_owners(adapter, replica_ids, self.owner_count(adapter, len(replica_ids)))

    def owner_count(self, adapter: str, replicas: int) -> int:
        """``k = clamp(ceil(share x replicas x owner_factor), min_owners, max_owners)``, at most ``replicas``."""
        c, now = self.config, self.clock()
        share = self.counts.count(adapter, now) / max(self.counts.total(now), c.min_total)
        k = max(c.min_owners, min(c.max_owners, math.ceil(share * replicas * c.owner_factor)))
        return min(k, replicas)

    def handover(self, before: Sequence[str], after: Sequence[str], top: int = 64) -> list[Prewarm]:
        """The replica set changed from ``before`` to ``after`` (one joined, or left): of the ``top``
        busiest adapters remembered, each owner in ``after`` that was not one in ``before`` is named
        to pre-warm it: a joining replica's share, a leaving one's adapters on their next owners."""
        now = self.clock()
        busiest = sorted(self.counts.keys(), key=lambda a: (-self.counts.count(a, now), a))[:top]
        out = []
        for adapter in busiest:
            old = set(rendezvous_owners(adapter, before, self.owner_count(adapter, len(before)))) if before else set()
            new = rendezvous_owners(adapter, after, self.owner_count(adapter, len(after))) if after else []
            out += [Prewarm(adapter, rid) for rid in new if rid not in old]
        return out

    def spill_owners(self, adapter: str, replica_ids: Sequence[str]) -> list[str]:
        """The live replicas ``adapter``'s recent spills went to, least recently used first (those
        unused for ``spill_ttl_s`` are forgotten here)."""
        held = self._spill_owners.get(adapter)
        if not held:
            return []
        now = self.clock()
        for rid, last in list(held.items()):
            if now - last > self.config.spill_ttl_s:
                del held[rid]
        if not held:
            del self._spill_owners[adapter]
        live = set(replica_ids)
        return [rid for rid in held if rid in live]

    def take_prewarms(self) -> list[Prewarm]:
        """The pre-warms decided since the last call (the caller carries them out)."""
        out, self._prewarms = self._prewarms, []
        return out

    # -- the rules ------------------------------------------------------------------------------------

    def _owner_count(self, adapter: str, ranked: list[str], by_id: dict[str, ReplicaView]) -> int:
        """The owner count now; pre-warms for the owners it gained since the adapter's last request."""
        k = self.owner_count(adapter, len(ranked))
        before = self._owners.get(adapter)
        if before is not None and k > before:
            self._prewarms += [Prewarm(adapter, rid) for rid in ranked[before:k] if adapter not in by_id[rid].pool]
        self._owners[adapter] = k
        self._owners.move_to_end(adapter)
        while len(self._owners) > self.config.max_tracked:
            self._owners.popitem(last=False)
        return k

    def _remember_spill(self, adapter: str, replica_id: str, now: float) -> None:
        if self.config.spill_owners == 0:
            return
        held = self._spill_owners.setdefault(adapter, OrderedDict())
        self._spill_owners.move_to_end(adapter)
        held[replica_id] = now
        held.move_to_end(replica_id)
        while len(held) > self.config.spill_owners:
            held.popitem(last=False)
        while len(self._spill_owners) > self.config.max_tracked:
            self._spill_owners.popitem(last=False)

    def _under(self, r: ReplicaView) -> bool:
        return r.in_flight < self.config.spill_load * r.capacity and r.kv_free >= self.config.kv_reserve

    def _guard(self, adapter: str, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Replicas that may take ``adapter``: not past the guard, or holding it already; all of
        them when every one is past it (the request must go somewhere)."""
        ok = [
            r
            for r in replicas
            if r.pinned_fraction < self.config.pinned_guard or adapter in r.pool or adapter in r.host
        ]
        if len(ok) < len(replicas):
            self.guarded += 1
        return ok or list(replicas)

    @staticmethod
    def _least_tokens(replicas: Sequence[ReplicaView]) -> ReplicaView:
        return min(replicas, key=lambda r: (r.tokens_in_flight, r.load, r.replica_id))

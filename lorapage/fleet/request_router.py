"""Adapter-affinity routing as a Ray Serve request router (``RequestRouterConfig.request_router_class``).

Ray Serve's router lives in the caller (the ingress) and asks :meth:`choose_replicas` for ranked
candidates; it then sends to the least-loaded replica of the first rank that accepts (below Ray's
``max_ongoing_requests``). This router ranks the replica our pure policy
(:mod:`lorapage.fleet.routing`) chooses first and every other one after it, least loaded first,
so Ray's own backpressure still applies. The policy sees one :class:`ReplicaView` per replica:

- the adapter is the request's ``multiplexed_model_id`` (the ingress sets it; "" for the base; a
  :func:`~lorapage.fleet.routing.replica_target` names one replica, which alone is a candidate);
- ``in_flight`` is the requests this router sent the replica that have not completed (counted
  the moment each is sent), or Ray's queue-length cache where that is higher;
- ``capacity``, ``pool``, ``host``, ``disk`` and, for ``affinity_load``, ``tokens_in_flight``,
  ``kv_free`` and the held adapter bytes come from the replica's ``record_routing_stats`` (up to
  ``request_routing_stats_period_s`` old: between two reports only ``in_flight`` moves).

Under ``affinity_load`` a replica that joins (autoscaling, a restart) is handed the busiest
adapters it now owns to pre-warm, and is ranked after every other replica until its reported pool
holds them or its pre-warm loads have settled (:class:`~lorapage.fleet.prewarm.JoinGate`): it
takes traffic warm.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lorapage.fleet.prewarm import JoinGate, ask_prewarm
from lorapage.fleet.routing import LoadAffinityRouter, Prewarm, ReplicaView, Router, make_router, targeted_replica


def replica_view(replica_id: str, queued: int | None, max_ongoing: int, stats: Mapping[str, Any]) -> ReplicaView:
    """A router's view of one replica from Ray's queue length (``None``: unknown) and its routing
    stats (``max_ongoing``: its capacity until they arrive)."""
    in_flight = queued if queued is not None else int(stats.get("in_flight", 0))
    return ReplicaView(
        replica_id=replica_id,
        in_flight=in_flight,
        capacity=int(stats.get("capacity", max_ongoing)),
        pool=frozenset(stats.get("pool", ())),
        host=frozenset(stats.get("host", ())),
        disk=frozenset(stats.get("disk", ())),
        tokens_in_flight=int(stats.get("tokens_in_flight", 0)),
        kv_free=float(stats.get("kv_free", 1.0)),
        pinned_bytes=int(stats.get("pinned_bytes", 0)),
        adapter_room_bytes=int(stats.get("adapter_room_bytes", 0)),
        held_slots=int(stats.get("held_slots", 0)),
        slots=int(stats.get("slots", 0)),
    )


class AffinityRequestRouter(RequestRouter):
    """Ray Serve request router over a :mod:`lorapage.fleet.routing` policy (affinity by default)."""

    policy: Router
    capacity: int | None
    sent: Counter[str]

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Ray Serve with ``request_router_kwargs``: ``policy`` (a router name) and its options."""
        options = dict(kwargs)
        self.capacity = int(options.pop("capacity", 0)) or None  # every engine's max_num_seqs
        # Requests this router sent and that have not completed, per replica. Ray's queue-length
        # cache is kept only under strict max_ongoing_requests, and the replicas' own reports are
        # up to a second old: a burst would all go to one owner before either counted it.
        self.sent: Counter[str] = Counter()
        self.policy = make_router(str(options.pop("policy", "affinity")), clock=time.monotonic, **options)
        self.members: list[str] = []  # the replica ids of the last choice (a change: one joined or left)
        self.gate = JoinGate(time.monotonic)  # joined replicas wait for their pre-warms before traffic

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.sent[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self.sent[replica_id.unique_id] > 0:  # also called for a request that failed before it was sent
            self.sent[replica_id.unique_id] -= 1

    def _view(self, replica: RunningReplica) -> ReplicaView:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        queued = max(cached or 0, self.sent[replica.replica_id.unique_id])
        return replica_view(
            replica.replica_id.unique_id,
            queued,
            self.capacity or replica.max_ongoing_requests,
            replica.routing_stats or {},
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        adapter = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if (target := targeted_replica(adapter)) is not None:  # that replica or none (the caller times out)
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        views = {r.replica_id.unique_id: self._view(r) for r in candidate_replicas}
        handover, warming = (
            self._join(self.policy, views, candidate_replicas)
            if isinstance(self.policy, LoadAffinityRouter)
            else ([], frozenset())
        )
        chosen = self.policy.choose(adapter or None, [v for rid, v in views.items() if rid not in warming])
        if isinstance(self.policy, LoadAffinityRouter):  # new owners load it at their next heartbeat
            for p in [*handover, *self.policy.take_prewarms()]:
                ask_prewarm(p.replica_id, p.adapter)
        ranks = [[r for r in candidate_replicas if r.replica_id.unique_id == chosen]]
        for held in (False, True):  # the others least loaded first; a joining replica still warming last
            rank = [
                r
                for r in candidate_replicas
                if r.replica_id.unique_id != chosen and (r.replica_id.unique_id in warming) == held
            ]
            if rank:
                ranks.append(sorted(rank, key=lambda r: (views[r.replica_id.unique_id].load, r.replica_id.unique_id)))
        return ranks

    def _join(
        self, policy: LoadAffinityRouter, views: Mapping[str, ReplicaView], replicas: list[RunningReplica]
    ) -> tuple[list[Prewarm], frozenset[str]]:
        """A replica joined (autoscaling, a restart) or left since the last choice: the busiest
        adapters' new owners are named to pre-warm them, and one that joined is held back from
        traffic until they are resident in its pool or its pre-warm loads have settled (the join
        sequence). The pre-warms, and the replicas still warming (none when every one is: the
        requests must go somewhere)."""
        members = sorted(views)
        handover: list[Prewarm] = []
        if self.members and members != self.members:
            handover = policy.handover(self.members, members)
            for rid in set(members) - set(self.members):
                self.gate.join(rid, (p.adapter for p in handover if p.replica_id == rid))
        self.members = members
        settled = {r.replica_id.unique_id: int((r.routing_stats or {}).get("prewarms_settled", 0)) for r in replicas}
        warming = self.gate.warming({rid: v.pool for rid, v in views.items()}, settled)
        return handover, warming if len(warming) < len(views) else frozenset()

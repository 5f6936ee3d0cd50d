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
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lorapage.fleet.prewarm import ask_prewarm
from lorapage.fleet.routing import LoadAffinityRouter, ReplicaView, Router, make_router, targeted_replica


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
        chosen = self.policy.choose(adapter or None, list(views.values()))
        if isinstance(self.policy, LoadAffinityRouter):  # new owners load it at their next heartbeat
            members = sorted(views)
            # A replica joined (autoscaling, a restart) or left: the busiest adapters' new owners warm them.
            handover = self.policy.handover(self.members, members) if self.members and members != self.members else []
            self.members = members
            for p in [*handover, *self.policy.take_prewarms()]:
                ask_prewarm(p.replica_id, p.adapter)
        first = [r for r in candidate_replicas if r.replica_id.unique_id == chosen]
        rest = sorted(
            (r for r in candidate_replicas if r.replica_id.unique_id != chosen),
            key=lambda r: (views[r.replica_id.unique_id].load, r.replica_id.unique_id),
        )
        return [first, rest] if rest else [first]

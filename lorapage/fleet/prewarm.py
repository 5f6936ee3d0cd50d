"""Pre-warms from the request router to the replicas, through the heartbeat.

The ``affinity_load`` router (:mod:`lorapage.fleet.routing`) names a :class:`Prewarm` when an
adapter gains owners. Ray Serve runs the request router inside the ingress's process (the handle
that sends to the engine replicas lives there), so the router drops each one in :data:`PREWARMS`
and the ingress hands a replica its own in the reply to its next heartbeat
(``SyncReply.prewarms``), which the replica turns into ``Engine.load_adapter``. A pre-warm is a
hint: at most ``per_replica`` wait per replica (the oldest are dropped), and one that a replica
never asks for (it died) is forgotten with it after ``max_replicas`` others.

A replica that joins the running fleet (autoscaling, a restart) is handed the busiest adapters it
now owns (``LoadAffinityRouter.handover``) and, by :class:`JoinGate`, takes traffic only once they
are resident: the seed's join sequence (load the base, register, pre-warm, then serve).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping


class PrewarmBox:
    """Adapters to pre-warm, per replica id; thread-safe (Ray's router may run on its own thread)."""

    def __init__(self, per_replica: int = 64, max_replicas: int = 1024) -> None:
        self.per_replica = per_replica
        self.max_replicas = max_replicas
        self._lock = threading.Lock()
        self._by_replica: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()

    def put(self, replica_id: str, adapter: str) -> None:
        """Ask ``replica_id`` to load ``adapter`` (once, however often asked before it takes it)."""
        with self._lock:
            wanted = self._by_replica.setdefault(replica_id, OrderedDict())
            self._by_replica.move_to_end(replica_id)
            wanted[adapter] = None
            wanted.move_to_end(adapter)
            while len(wanted) > self.per_replica:
                wanted.popitem(last=False)
            while len(self._by_replica) > self.max_replicas:
                self._by_replica.popitem(last=False)

    def take(self, replica_id: str) -> tuple[str, ...]:
        """The adapters waiting for ``replica_id``, oldest first; they are handed over once."""
        with self._lock:
            return tuple(self._by_replica.pop(replica_id, ()))


PREWARMS = PrewarmBox()  # the ingress process's: the request router puts, the ingress takes


def ask_prewarm(replica_id: str, adapter: str) -> None:
    """Put a pre-warm in this process's :data:`PREWARMS`. The request router calls this function
    rather than naming the box: Ray Serve pickles the router's module by value, which would copy
    the box (and fail on its lock); a function of this module travels by reference."""
    PREWARMS.put(replica_id, adapter)


JOIN_WARM_S = 30.0  # how long a joining replica's traffic waits for its pre-warms at most


class JoinGate:
    """The join sequence's last step in the request router: a replica that joined (autoscaling, a
    restart) takes traffic once the adapters it was handed are resident in its pool, or once it
    reports as many pre-warm loads settled (loaded or failed: a pool too small for them all, a
    load that failed), or after ``timeout_s`` (a replica that never reports). Until then the
    router ranks it after every other replica, so it is sent a request only when the others
    refuse one."""

    def __init__(self, clock: Callable[[], float], timeout_s: float = JOIN_WARM_S) -> None:
        self.clock = clock
        self.timeout_s = timeout_s
        self._waiting: dict[str, tuple[frozenset[str], float]] = {}  # replica id -> (adapters, deadline)

    def join(self, replica_id: str, adapters: Iterable[str]) -> None:
        """``replica_id`` joined and was asked to pre-warm ``adapters`` (none: it takes traffic now)."""
        if wanted := frozenset(adapters):
            self._waiting[replica_id] = (wanted, self.clock() + self.timeout_s)

    def warming(self, pools: Mapping[str, frozenset[str]], settled: Mapping[str, int]) -> frozenset[str]:
        """The replicas still warming, given each live replica's pool (``pools``) and pre-warm
        loads settled since it started (``settled``); the ones that left, hold their adapters,
        settled as many loads or waited ``timeout_s`` are let through, once and for all."""
        now = self.clock()
        for rid, (adapters, deadline) in list(self._waiting.items()):
            done = adapters <= pools.get(rid, adapters) or settled.get(rid, 0) >= len(adapters)
            if rid not in pools or done or now >= deadline:
                del self._waiting[rid]
        return frozenset(self._waiting)

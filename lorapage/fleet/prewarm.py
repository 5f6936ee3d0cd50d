"""Pre-warms from the request router to the replicas, through the heartbeat.

The ``affinity_load`` router (:mod:`lorapage.fleet.routing`) names a :class:`Prewarm` when an
adapter gains owners. Ray Serve runs the request router inside the ingress's process (the handle
that sends to the engine replicas lives there), so the router drops each one in :data:`PREWARMS`
and the ingress hands a replica its own in the reply to its next heartbeat
(``SyncReply.prewarms``), which the replica turns into ``Engine.load_adapter``. A pre-warm is a
hint: at most ``per_replica`` wait per replica (the oldest are dropped), and one that a replica
never asks for (it died) is forgotten with it after ``max_replicas`` others.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


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

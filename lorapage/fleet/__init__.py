"""Beyond one machine: routing requests across engine replicas.

Import-light on purpose: :mod:`lorapage.fleet.routing` is pure and shared with the simulator, so
importing this package must never import Ray (the Ray Serve application lives in its own module
and needs the ``[fleet]`` extra).
"""

from lorapage.fleet.routing import (
    ROUTERS,
    AffinityRouter,
    LeastLoadedRouter,
    RandomRouter,
    RayDefaultRouter,
    ReplicaView,
    ResidencyBonus,
    Router,
    make_router,
    rendezvous_owners,
)

__all__ = [
    "ROUTERS",
    "AffinityRouter",
    "LeastLoadedRouter",
    "RandomRouter",
    "RayDefaultRouter",
    "ReplicaView",
    "ResidencyBonus",
    "Router",
    "make_router",
    "rendezvous_owners",
]

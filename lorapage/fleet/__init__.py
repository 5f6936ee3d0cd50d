"""Beyond one machine: routing requests across engine replicas.

Import-light on purpose: :mod:`lorapage.fleet.routing` is pure and shared with the simulator, so
importing this package must never import Ray (the Ray Serve application lives in its own module
and needs the ``[fleet]`` extra).
"""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.fleet.routing import (
        ROUTERS as ROUTERS,
        AffinityRouter as AffinityRouter,
        LeastLoadedRouter as LeastLoadedRouter,
        LoadAffinityConfig as LoadAffinityConfig,
        LoadAffinityRouter as LoadAffinityRouter,
        Prewarm as Prewarm,
        RandomRouter as RandomRouter,
        RayDefaultRouter as RayDefaultRouter,
        ReplicaView as ReplicaView,
        ResidencyBonus as ResidencyBonus,
        Router as Router,
        make_router as make_router,
        rendezvous_owners as rendezvous_owners,
    )

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "ROUTERS": "lorapage.fleet.routing",
        "AffinityRouter": "lorapage.fleet.routing",
        "LoadAffinityConfig": "lorapage.fleet.routing",
        "LoadAffinityRouter": "lorapage.fleet.routing",
        "Prewarm": "lorapage.fleet.routing",
        "LeastLoadedRouter": "lorapage.fleet.routing",
        "RandomRouter": "lorapage.fleet.routing",
        "RayDefaultRouter": "lorapage.fleet.routing",
        "ReplicaView": "lorapage.fleet.routing",
        "ResidencyBonus": "lorapage.fleet.routing",
        "Router": "lorapage.fleet.routing",
        "make_router": "lorapage.fleet.routing",
        "rendezvous_owners": "lorapage.fleet.routing",
    },
)

"""Which replica takes a request: pure routing policies shared by the Ray fleet and the simulator.

A router sees only :class:`ReplicaView` snapshots (load and residency each replica reported) and
the request's adapter; it owns no Ray handle and no I/O, so the Ray Serve request router and
``lorapage.sim.fleet`` call the very same ``choose``. Randomised routers take a seed; the
``affinity`` router's memory of temporary owners ages in *number of choices*; ``affinity_load``
(:mod:`~lorapage.fleet.routing.placement`) takes a clock, which the simulator makes virtual. So the
same sequence of calls always gives the same answers.
"""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.fleet.routing.factory import (
        ROUTERS as ROUTERS,
        make_router as make_router,
    )
    from lorapage.fleet.routing.placement import (
        DecayingCounts as DecayingCounts,
        LoadAffinityConfig as LoadAffinityConfig,
        LoadAffinityRouter as LoadAffinityRouter,
        Prewarm as Prewarm,
    )
    from lorapage.fleet.routing.policies import (
        AffinityRouter as AffinityRouter,
        LeastLoadedRouter as LeastLoadedRouter,
        RandomRouter as RandomRouter,
        RayDefaultRouter as RayDefaultRouter,
        ReplicaView as ReplicaView,
        ResidencyBonus as ResidencyBonus,
        Router as Router,
        rendezvous_owners as rendezvous_owners,
        replica_target as replica_target,
        targeted_replica as targeted_replica,
    )

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "ROUTERS": "lorapage.fleet.routing.factory",
        "make_router": "lorapage.fleet.routing.factory",
        "DecayingCounts": "lorapage.fleet.routing.placement",
        "LoadAffinityConfig": "lorapage.fleet.routing.placement",
        "LoadAffinityRouter": "lorapage.fleet.routing.placement",
        "Prewarm": "lorapage.fleet.routing.placement",
        "AffinityRouter": "lorapage.fleet.routing.policies",
        "LeastLoadedRouter": "lorapage.fleet.routing.policies",
        "RandomRouter": "lorapage.fleet.routing.policies",
        "RayDefaultRouter": "lorapage.fleet.routing.policies",
        "ReplicaView": "lorapage.fleet.routing.policies",
        "ResidencyBonus": "lorapage.fleet.routing.policies",
        "Router": "lorapage.fleet.routing.policies",
        "rendezvous_owners": "lorapage.fleet.routing.policies",
        "replica_target": "lorapage.fleet.routing.policies",
        "targeted_replica": "lorapage.fleet.routing.policies",
    },
)

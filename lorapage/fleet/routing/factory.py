"""The routers by name: ``make_router`` builds any of :data:`ROUTERS` alike for the simulator, the
Ray request router and the command lines."""

from __future__ import annotations

from lorapage.fleet.routing.placement import LoadAffinityConfig, LoadAffinityRouter
from lorapage.fleet.routing.policies import AffinityRouter, LeastLoadedRouter, RandomRouter, RayDefaultRouter, Router

ROUTERS = ("random", "least_loaded", "affinity", "affinity_load", "ray_default")


def make_router(name: str, **kw: object) -> Router:
    """The router called ``name`` (one of :data:`ROUTERS`), built with keyword options ``kw``.

    ``seed`` and ``clock`` (a callable giving seconds) are accepted for every router (those that
    need neither ignore them), so a caller can build them all alike; the other options are the
    :class:`AffinityRouter` arguments, or for ``affinity_load`` those of
    :class:`~lorapage.fleet.routing.LoadAffinityConfig`.
    """
    seed = kw.pop("seed", 0)
    clock = kw.pop("clock", None)
    if not isinstance(seed, int):
        raise ValueError(f"router seed must be an int; got {seed!r}")
    if name == "affinity_load":
        if not callable(clock):
            raise ValueError("router 'affinity_load' needs a clock (a callable giving seconds)")
        try:
            return LoadAffinityRouter(clock, LoadAffinityConfig(**kw))  # type: ignore[arg-type]
        except TypeError as exc:
            raise ValueError(f"router 'affinity_load': {exc}") from None
    if name == "affinity":
        return AffinityRouter(**kw)  # type: ignore[arg-type]
    if kw:
        raise ValueError(f"router {name!r} takes no options besides seed; got {sorted(kw)}")
    if name == "random":
        return RandomRouter(seed)
    if name == "least_loaded":
        return LeastLoadedRouter()
    if name == "ray_default":
        return RayDefaultRouter(seed)
    raise ValueError(f"router must be one of {ROUTERS}; got {name!r}")

"""The fleet as one Ray Serve application: :class:`FleetIngress` bound to ``replicas`` :class:`EngineReplica`\\ s.

The engine deployment names :class:`~lorapage.fleet.request_router.AffinityRequestRouter` as its
request router, so every handle to it (the ingress's) routes by adapter affinity, and Ray Serve
polls each replica's ``record_routing_stats`` for the residency the router prefers. Ray places
and restarts the replicas; a replica whose process dies is replaced under a new replica id.
The ingress serves HTTP itself (:mod:`lorapage.fleet.ingress`): start Serve with its proxy off
(``serve.start(proxy_location="Disabled")``); the application has no HTTP route of Ray's.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from lorapage.config import EngineConfig
from lorapage.fleet.autoscale import autoscaling_config
from lorapage.fleet.bases import base_engine
from lorapage.fleet.config import APP_NAME, ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, FleetConfig, base_deployment
from lorapage.fleet.ingress import FleetIngress
from lorapage.fleet.replica import EngineReplica
from lorapage.fleet.request_router import AffinityRequestRouter

ENGINE_DRAIN_S = 300.0  # an autoscaled replica's drain: a 2,000-token generation at 50 ms a token is 100 s
RAY_SHUTDOWN_S = 20.0  # Ray Serve's default graceful_shutdown_timeout_s (a fixed fleet keeps it)
INGRESS_SHUTDOWN_S = 30.0  # Ray's graceful shutdown of the ingress: > the 10 s grace + 5 s + 5 s it may take

__all__ = ["APP_NAME", "ENGINE_DEPLOYMENT", "INGRESS_DEPLOYMENT", "build_app"]


def build_app(config: FleetConfig) -> Application:
    """The bound application: run it with ``serve.run(build_app(config), name=APP_NAME)``; the
    ingress listens on ``config.host:config.port``."""
    router = {  # Ray Serve's RequestRouterConfig
        "request_router_class": AffinityRequestRouter,
        # capacity: what a replica counts as saturated before its first routing stats arrive.
        "request_router_kwargs": {
            "policy": config.router,
            "capacity": config.engine.max_num_seqs,
            **config.router_options(),
        },
        "request_routing_stats_period_s": config.routing_stats_period_s,
    }

    def engine_deployment(name: str, engine: EngineConfig) -> Application:
        # Autoscaled: Ray Serve runs lorapage.fleet.autoscale's policy over the replicas'
        # record_autoscaling_stats (queue depth, tokens in flight, KV headroom).
        auto = None if config.autoscale is None else autoscaling_config(config.autoscale)
        return serve.deployment(
            name=name,
            num_replicas=config.replicas if auto is None else "auto",
            autoscaling_config=auto,
            # A replica scaled down stops taking requests at once; Ray then waits this long for the
            # ones under way (streams of long generations) before it stops the process.
            graceful_shutdown_timeout_s=ENGINE_DRAIN_S if auto is not None else RAY_SHUTDOWN_S,
            max_ongoing_requests=config.max_ongoing_requests,
            request_router_config=router,
            **config.engine_options(engine),  # its CPUs and GPUs; a placement group of one bundle per TP rank
        )(EngineReplica).bind(engine, config.sync_period_s, config.roots())

    engines = engine_deployment(ENGINE_DEPLOYMENT, config.engine)
    # --base: one deployment per other base, routed to by the ingress (lorapage.fleet.bases).
    sides = [engine_deployment(base_deployment(m), base_engine(config.engine, m)) for m in config.bases]
    # One ingress replica: it holds the tenants' token buckets, which makes quotas fleet-wide.
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=max(1000, config.max_replicas() * config.max_ongoing_requests),
        ray_actor_options={"num_cpus": config.ingress_cpus},
        # Its shutdown drains the front end: the grace period, then 5 s for aborted requests and
        # aiohttp's own 5 s; Ray's default (20 s) would cut the last of that short.
        graceful_shutdown_timeout_s=INGRESS_SHUTDOWN_S,
    )(FleetIngress)
    return ingress.bind(engines, config, sides)

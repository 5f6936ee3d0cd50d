"""Building the configured scheduling policy."""

from __future__ import annotations

from collections.abc import Mapping

from lorapage.config import SCHEDULERS
from lorapage.scheduler.base import R, SchedulerPolicy
from lorapage.scheduler.fcfs import FcfsScheduler
from lorapage.scheduler.metrics import MeteredPolicy, SchedulerMetrics
from lorapage.scheduler.vtc import VtcConfig, VtcScheduler


def make_policy(
    name: str,
    *,
    vtc: VtcConfig | None = None,
    tenant_weights: Mapping[str, float] | None = None,
    metrics: SchedulerMetrics | None = None,
) -> SchedulerPolicy[R]:
    """The policy called ``name`` ("fcfs" or "vtc"), recording into ``metrics`` when given.

    ``vtc`` and ``tenant_weights`` configure VTC: build ``vtc`` with ``max_loras``,
    ``reserved_tail_lanes`` and ``age_deadline_s`` from the engine config (``lane_age_deadline_s``)
    and the weights from the tenants file. FCFS takes only ``vtc.max_loras``, the distinct adapters
    a batch may hold. The request type comes from the caller:
    ``policy: SchedulerPolicy[Request] = make_policy(...)``.
    """
    policy: SchedulerPolicy[R]
    if name == "vtc":
        policy = VtcScheduler(vtc, tenant_weights)
    elif name == "fcfs":
        policy = FcfsScheduler((vtc or VtcConfig()).max_loras)
    else:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}; got {name!r}")
    return MeteredPolicy(policy, metrics) if metrics is not None else policy

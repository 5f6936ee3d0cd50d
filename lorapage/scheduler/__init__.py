"""Scheduling policies: which waiting request joins the batch, and whom to preempt."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.scheduler.base import (
        AdmissionContext as AdmissionContext,
        SchedRequest as SchedRequest,
        SchedulerPolicy as SchedulerPolicy,
    )
    from lorapage.scheduler.fcfs import FcfsScheduler as FcfsScheduler
    from lorapage.scheduler.metrics import MeteredPolicy as MeteredPolicy, SchedulerMetrics as SchedulerMetrics
    from lorapage.scheduler.policies import make_policy as make_policy
    from lorapage.scheduler.vtc import VtcConfig as VtcConfig, VtcScheduler as VtcScheduler

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "AdmissionContext": "lorapage.scheduler.base",
        "FcfsScheduler": "lorapage.scheduler.fcfs",
        "MeteredPolicy": "lorapage.scheduler.metrics",
        "SchedRequest": "lorapage.scheduler.base",
        "SchedulerMetrics": "lorapage.scheduler.metrics",
        "SchedulerPolicy": "lorapage.scheduler.base",
        "VtcConfig": "lorapage.scheduler.vtc",
        "VtcScheduler": "lorapage.scheduler.vtc",
        "make_policy": "lorapage.scheduler.policies",
    },
)

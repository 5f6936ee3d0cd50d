"""First-come, first-served admission: the baseline policy."""

from __future__ import annotations

import bisect
from typing import Generic

from lorapage.scheduler.base import AdmissionContext, R


class FcfsScheduler(Generic[R]):
    """Admit in arrival order. A request whose adapter is still loading is passed over (it keeps
    its place) so it blocks nobody; the first request that does not fit ends the step's admission,
    so a large request is not overtaken indefinitely."""

    def __init__(self) -> None:
        self._waiting: list[R] = []

    def add(self, req: R, now: float) -> None:
        bisect.insort(self._waiting, req, key=lambda r: r.arrival_time)

    def preempt(self, req: R, now: float) -> None:
        self.add(req, now)  # back in its arrival order, ahead of later arrivals

    def remove(self, req: R) -> None:
        if req in self._waiting:
            self._waiting.remove(req)

    def schedule(self, now: float, ctx: AdmissionContext[R]) -> list[R]:
        admitted: list[R] = []
        for req in list(self._waiting):
            if not ctx.adapter_ready(req):
                continue
            if not ctx.try_admit(req):
                break
            self._waiting.remove(req)
            admitted.append(req)
        return admitted

    def on_service(self, req: R, input_tokens: int, output_tokens: int, now: float) -> None:
        pass

    def on_finish(self, req: R, now: float) -> None:
        pass

    def pick_victim(self, running: list[R]) -> R:
        return max(running, key=lambda r: r.arrival_time)

    def num_waiting(self) -> int:
        return len(self._waiting)

"""First-come, first-served admission: the baseline policy."""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Generic

from lorapage.scheduler.base import AdmissionContext, R


class FcfsScheduler(Generic[R]):
    """Admit in arrival order. A request whose adapter is still loading, or would be one adapter
    past ``max_loras`` distinct in the batch (vLLM's rule), is passed over (it keeps its place) so
    it blocks nobody; the first request that does not fit ends the step's admission, so a large
    request is not overtaken indefinitely."""

    def __init__(self, max_loras: int | None = None) -> None:
        self.max_loras = max_loras  # distinct adapters the running batch may hold; None: no cap
        self._waiting: list[R] = []
        self._running: dict[str, str] = {}  # request_id -> adapter, of running requests on an adapter
        self._adapters: Counter[str] = Counter()  # adapter -> running requests on it

    def add(self, req: R, now: float) -> None:
        bisect.insort(self._waiting, req, key=lambda r: r.arrival_time)

    def preempt(self, req: R, now: float) -> None:
        self._release(req)
        self.add(req, now)  # back in its arrival order, ahead of later arrivals

    def remove(self, req: R) -> None:
        if req in self._waiting:
            self._waiting.remove(req)

    def reclaim(self, now: float) -> list[R]:
        return []  # no lane is lent

    def schedule(self, now: float, ctx: AdmissionContext[R]) -> list[R]:
        admitted: list[R] = []
        for req in list(self._waiting):
            if not ctx.adapter_ready(req) or self._lane_full(req):
                continue
            if not ctx.try_admit(req):
                break
            self._waiting.remove(req)
            admitted.append(req)
            if req.adapter is not None:
                self._running[req.request_id] = req.adapter
                self._adapters[req.adapter] += 1
        return admitted

    def _lane_full(self, req: R) -> bool:
        """``req`` needs an adapter not in the batch, which holds ``max_loras`` distinct already."""
        cap = self.max_loras
        return (
            cap is not None
            and req.adapter is not None
            and req.adapter not in self._adapters
            and (len(self._adapters) >= cap)
        )

    def _release(self, req: R) -> None:
        adapter = self._running.pop(req.request_id, None)
        if adapter is not None:
            self._adapters[adapter] -= 1
            if not self._adapters[adapter]:
                del self._adapters[adapter]

    def on_service(self, req: R, input_tokens: int, output_tokens: int, now: float) -> None:
        pass

    def on_finish(self, req: R, now: float) -> None:
        self._release(req)

    def pick_victim(self, running: list[R]) -> R:
        return max(running, key=lambda r: r.arrival_time)

    def num_waiting(self) -> int:
        return len(self._waiting)

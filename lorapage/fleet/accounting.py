"""What the fleet's ingress records of each answered request: its tenant's SLOs and its access-log line.

The ingress sees every request of the fleet, so it judges them as ``lorapage serve`` does
(:func:`~lorapage.server.slo.request_outcome` into a :class:`~lorapage.server.slo.SloTracker`,
exported as the same ``lorapage_tenant_*`` series) and writes the same request-log line
(:func:`~lorapage.server.access_log.line`). TTFT and ITL are what the ingress measured: from the
request's arrival at the ingress to its first token coming back from a replica (the proxy hop in
front is not in it). A streamed answer is recorded when its stream ends (its status is 200, an
error event in it counts as the failure it reports); any other answer when it is returned.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from lorapage.server.access_log import AccessLog, line
from lorapage.server.generation import Job
from lorapage.server.slo import SloTracker, request_outcome


class RequestAccounting:
    """Records answered requests into ``slo`` and, when given, ``access_log``; ``clock`` is
    monotonic seconds (``started`` and the SLO window are on it)."""

    def __init__(
        self, slo: SloTracker, access_log: AccessLog | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.slo, self.access_log, self.clock = slo, access_log, clock

    def finished(self, method: str, route: str, status: int, started: float, job: Job | None) -> None:
        """One request answered with ``status``; ``job`` when it was a generation request that ran."""
        now = self.clock()
        if job is not None:
            outcome = request_outcome(status, job.stream_error, job.ttft_s, job.mean_itl_s)
            if outcome is not None:
                self.slo.record(job.tenant, outcome, now)
        if self.access_log is not None:
            self.access_log.write(line(method, route, status, now - started, job))


async def until_end(body: AsyncIterable[Any], on_end: Callable[[], None]) -> AsyncIterator[Any]:
    """``body`` passed through, then ``on_end()`` once it ends, fails or the client goes away
    (``body`` is closed first, so what its own ending records is in)."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()
        on_end()

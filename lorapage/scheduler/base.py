"""The seam between the engine and its scheduling policy.

A policy is pure: it orders waiting requests and decides admission using only the numbers on
each request, the ``now`` it is handed, and the questions it may ask the engine through
:class:`AdmissionContext`. It owns no pages, no device and no clock, so it runs under a fake clock in
unit tests and inside the simulator unchanged.
"""

from __future__ import annotations

from typing import Protocol


class SchedRequest(Protocol):
    """What a policy may read of a request."""

    request_id: str
    tenant: str
    adapter: str | None
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int


class AdmissionContext(Protocol):
    """Questions a policy asks the engine while choosing whom to admit this step."""

    def adapter_ready(self, req: SchedRequest) -> bool:
        """True when the request's adapter is resident (or it has none). Asking starts no load:
        the engine started the fetch when the request arrived."""

    def running_adapters(self) -> set[str | None]:
        """Adapters of the sequences already running (they stay in the batch)."""

    def try_admit(self, req: SchedRequest) -> bool:
        """Reserve what ``req`` needs (KV pages for its prompt, a batch row, token budget) and
        admit it; False, with nothing reserved, when any of them is short."""


class SchedulerPolicy(Protocol):
    """Chooses which waiting requests join the running batch, and whom to preempt."""

    def add(self, req: SchedRequest, now: float) -> None:
        """A request arrived (or came back after preemption) and waits."""

    def remove(self, req: SchedRequest) -> None:
        """A waiting request was aborted."""

    def schedule(self, now: float, ctx: AdmissionContext) -> list[SchedRequest]:
        """Admit waiting requests through ``ctx.try_admit``; return those admitted, in order."""

    def on_service(self, req: SchedRequest, input_tokens: int, output_tokens: int, now: float) -> None:
        """``req`` was served this many tokens (prefill input / generated output) this step."""

    def on_finish(self, req: SchedRequest, now: float) -> None:
        """A running request finished or was aborted."""

    def pick_victim(self, running: list[SchedRequest]) -> SchedRequest:
        """The running request to preempt (recompute later) when KV pages run out."""

    def num_waiting(self) -> int:
        """Requests waiting to be admitted."""

"""The seam between the engine and its scheduling policy.

A policy is pure: it orders waiting requests and decides admission using only the numbers on
each request, the ``now`` it is handed, and the questions it may ask the engine through
:class:`AdmissionContext`. It owns no pages, no device and no clock, so it runs under a fake clock in
unit tests and inside the simulator unchanged.

Policies are generic over the caller's request type ``R`` (the engine's ``Request``, the
simulator's ``SimRequest``), so ``schedule`` and ``pick_victim`` hand back that type.
"""

from __future__ import annotations

from typing import Protocol, TypeVar


class SchedRequest(Protocol):
    """What a policy may read of a request (read-only: a dataclass field or a property will do)."""

    @property
    def request_id(self) -> str: ...

    @property
    def tenant(self) -> str: ...

    @property
    def adapter(self) -> str | None: ...

    @property
    def arrival_time(self) -> float: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...


R = TypeVar("R", bound=SchedRequest)
R_contra = TypeVar("R_contra", bound=SchedRequest, contravariant=True)


class AdmissionContext(Protocol[R_contra]):
    """Questions a policy asks the engine while choosing whom to admit this step."""

    def adapter_ready(self, req: R_contra) -> bool:
        """True when the request's adapter is resident (or it has none). Asking starts no load:
        the engine started the fetch when the request arrived."""
        ...

    def try_admit(self, req: R_contra) -> bool:
        """Reserve what ``req`` needs (KV pages for its prompt, a batch row, token budget) and
        admit it; False, with nothing reserved, when any of them is short."""
        ...


class SchedulerPolicy(Protocol[R]):
    """Chooses which waiting requests join the running batch, and whom to preempt.

    Each request enters through ``add`` once; each admission ends in exactly one ``on_finish``
    or one ``preempt`` (after which the request waits again, to be admitted anew).
    """

    def add(self, req: R, now: float) -> None:
        """A new request arrived and waits."""
        ...

    def preempt(self, req: R, now: float) -> None:
        """A running request was preempted (its KV freed); it waits again and will recompute."""
        ...

    def remove(self, req: R) -> None:
        """A waiting request was aborted."""
        ...

    def reclaim(self, now: float) -> list[R]:
        """Running requests the engine is to preempt before this step's admissions (a lane owed
        back past its bound); asked once a step."""
        ...

    def schedule(self, now: float, ctx: AdmissionContext[R]) -> list[R]:
        """Admit waiting requests through ``ctx.try_admit``; return those admitted, in order."""
        ...

    def on_service(self, req: R, input_tokens: int, output_tokens: int, now: float) -> None:
        """``req`` was served this many tokens (prefill input / generated output) this step."""
        ...

    def on_finish(self, req: R, now: float) -> None:
        """A running request finished or was aborted."""
        ...

    def pick_victim(self, running: list[R]) -> R:
        """The running request to preempt (recompute later) when KV pages run out."""
        ...

    def num_waiting(self) -> int:
        """Requests waiting to be admitted."""
        ...

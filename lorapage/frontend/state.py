"""What the route modules need of the front end's state, as a Protocol.

:class:`lorapage.frontend.app.ServerState` is the one implementation, over a
:class:`~lorapage.frontend.backend.Backend`; the route modules are typed against this instead,
because ``app`` imports them and importing it back would cycle. The route modules both front ends
serve take a ``RouteState[Backend]`` (the admin routes reach what changes adapters through the
app's :class:`~lorapage.frontend.admin_ops.Admin`, not the backend).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from aiohttp import web

from lorapage.frontend.auth import Access
from lorapage.frontend.generation import Answer, Job, Timing
from lorapage.frontend.prompts import PromptBuilder
from lorapage.request import TokenStream
from lorapage.tenancy.quota import Reservation

B_co = TypeVar("B_co", covariant=True)
# How a job's engine outputs become its answer (generation.answer's role; /v1/responses brings its own).
AnswerWith = Callable[[TokenStream, Job, Timing], Awaitable[Answer]]


class RouteState(Protocol[B_co]):
    """Who may use what, the prompt builder, the requests in flight, admission, and the backend."""

    access: Access
    prompts: PromptBuilder
    max_body_bytes: int
    in_flight: Counter[str | None]  # adapter version id@N (None: base) -> requests running
    request_ids: set[str]  # the engine's ids of the requests in flight
    draining: set[str]  # adapter versions (id@N) being deleted: invisible to new requests
    closing: bool

    @property
    def backend(self) -> B_co:
        """Where requests go (:class:`~lorapage.frontend.backend.Backend`)."""
        ...

    def check_open(self) -> None:
        """503 once the server is shutting down."""
        ...

    def route(self, model: str, tenant: str) -> tuple[str, str | None]:
        """``model`` as ``tenant`` may name it: (the name answered, the adapter version or None)."""
        ...

    def admit(self, tenant: str) -> Reservation:
        """Take one of ``tenant``'s requests and a concurrency slot (429 when it has none)."""
        ...

    def release(self, reservation: Reservation, used_tokens: int = 0) -> None:
        """Give back what :meth:`admit` took."""
        ...

    async def run(
        self, request: web.Request, job: Job, reservation: Reservation, answer_with: AnswerWith | None = None
    ) -> web.StreamResponse:
        """Charge ``job``'s tokens, run it and answer it (``answer_with``: its own shapes)."""
        ...

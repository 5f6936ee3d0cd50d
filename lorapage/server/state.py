"""What the route modules need of the front end's state, as a Protocol.

:class:`lorapage.server.app.ServerState` is the one implementation, over a
:class:`~lorapage.server.backend.Backend`; the route modules are typed against this instead,
because ``app`` imports them and importing it back would cycle. The routes both front ends serve
take a ``RouteState[Backend]``; ``lorapage serve``'s own (admin, base migration, audit) a
:data:`ServeState`, whose backend is the engines in this process; the fleet's own, a state over
:class:`lorapage.fleet.backend.FleetBackend`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

from aiohttp import web

from lorapage.server.auth import Access
from lorapage.server.generation import Answer, Job, Timing
from lorapage.server.prompts import PromptBuilder
from lorapage.server.quota import Reservation

if TYPE_CHECKING:
    from lorapage.server.engine_backend import EngineBackend

B_co = TypeVar("B_co", covariant=True)
# How a job's engine outputs become its answer (generation.answer's role; /v1/responses brings its own).
AnswerWith = Callable[[AsyncGenerator[Any, None], Job, Timing], Awaitable[Answer]]


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
        """Where requests go (:class:`~lorapage.server.backend.Backend`)."""
        ...

    def check_open(self) -> None:
        """503 once the server is shutting down."""
        ...

    def resolve(self, model: str, tenant: str) -> tuple[str, str | None]:
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


ServeState: TypeAlias = "RouteState[EngineBackend]"  # lorapage serve's: the engines in this process

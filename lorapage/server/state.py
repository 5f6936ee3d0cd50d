"""What the route modules need of the server's state, as a Protocol.

:class:`lorapage.server.app.ServerState` is the one implementation; the route modules
(:mod:`lorapage.server.admin`, :mod:`lorapage.server.extra_routes`) are typed against this instead,
because ``app`` imports them and importing it back would cycle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from lorapage.server.auth import Access
from lorapage.server.generation import Job
from lorapage.server.metrics import ServerMetrics
from lorapage.server.prompt_sampler import PromptSampler
from lorapage.server.prompts import PromptBuilder
from lorapage.server.quota import AdmissionRate, Reservation

if TYPE_CHECKING:
    from lorapage.engine import Engine
    from lorapage.server.engines import Engines

# Runs a job on the engine and answers it over HTTP (generation.respond's signature).
Responder = Callable[[web.Request, "Engine", Job, ServerMetrics, AdmissionRate], Awaitable[web.StreamResponse]]


class RouteState(Protocol):
    """The engine, who may use what, the prompt builder, the requests in flight, and admission."""

    engine: Engine  # the primary: its registry is the server's
    engines: Engines  # every base served, the primary first (lorapage.server.engines)
    access: Access
    prompts: PromptBuilder
    sampler: PromptSampler  # check prompts sampled from opted-in adapters' traffic
    max_body_bytes: int
    in_flight: Counter[str | None]  # adapter version id@N (None: base) -> requests running
    request_ids: set[str]  # the engine's ids of the requests in flight
    draining: set[str]  # adapter versions (id@N) being deleted: invisible to new requests
    closing: bool

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
        self, request: web.Request, job: Job, reservation: Reservation, responder: Responder = ...
    ) -> web.StreamResponse:
        """Charge ``job``'s tokens, run it and answer it with ``responder``."""
        ...

"""The one HTTP front end, of ``lorapage serve`` and of the fleet's ingress: OpenAI-compatible
routes, health, metrics, usage, the middleware (error JSON, request counts and SLOs, the request
log), SSE, admission; parameterised by where requests go (:class:`~lorapage.frontend.backend.Backend`:
the engines in this process, :mod:`lorapage.serve.engine_backend`, or the fleet's replicas,
:mod:`lorapage.fleet.backend`). vLLM's extra routes and ``/v1/responses``: extra_routes.py. Each
side adds its own routes: ``lorapage serve`` its admin (admin.py), audit and base-migration
routes (:func:`create_app`); the fleet its admin routes (:mod:`lorapage.fleet.admin`).

Every request is checked in the same order, cheapest first, and takes its tenant's quota before
any work that grows with its body: API key (401), declared body size (413), the tenant's
requests per minute and its share of concurrency (429; nothing of the body has been read yet),
the body read, decoded and checked (400; bounded in size, messages and nesting, decoded off the
event loop when big), model visibility (404), a concurrency slot per sequence (prompts x n; 429),
prompt length against the context (400: first a
bound on characters, then, off the event loop and in the tenant's turn, the template and the
tokenizer, which stop at the context), the tenant's tokens per minute (429); only then does the
engine see it (503 when its queue is full). ``/health`` answers 503 once shutting down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from lorapage.frontend import protocol
from lorapage.frontend.access_log import JOB, AccessLog, access_log_middleware, status_when_cut
from lorapage.frontend.auth import Access
from lorapage.frontend.backend import Backend
from lorapage.frontend.bodies import check_body_length
from lorapage.frontend.edge import EDGE_LIMITS, EdgeLimits
from lorapage.frontend.error_json import Handler, error_middleware
from lorapage.frontend.extra_routes import add_extra_routes
from lorapage.frontend.generation import Job
from lorapage.frontend.job import make_job
from lorapage.frontend.metrics import CONTENT_TYPE
from lorapage.frontend.prompts import Prompts
from lorapage.frontend.state import STATE, ServerState
from lorapage.frontend.usage_route import usage_answer, usage_request
from lorapage.tenancy.slo import DEFAULT_WINDOW_S

if TYPE_CHECKING:
    pass

log = logging.getLogger("lorapage.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


BACKGROUND = web.AppKey("lorapage_background", set)  # audit writes started by a signal


def _job(state: ServerState, kind: str, parsed: protocol.Parsed, tenant: str, prompts: Prompts, arrival: float) -> Job:
    # Resolved again: the adapter may have been deleted (or re-pointed) while the prompt was tokenized.
    model, adapter = state.route(parsed.req.model, tenant)
    backend = state.backend
    job = make_job(
        kind,
        parsed,
        model,
        adapter,
        tenant,
        prompts.ids,
        backend.max_model_len,
        arrival,
        state.access,
        tools=prompts.tools,
        prompt_texts=prompts.texts,
        max_adapter_tokens=backend.max_adapter_tokens(adapter),
    )
    if kind == "chat" and state.reasoning_parser != "none":
        job.thinking_open = prompts.thinking_open
    return job


class CoreRoutes:
    """The OpenAI routes (chat, completions, models), health, metrics and usage: handlers over
    the front end's state, as every route module's are."""

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrival = time.monotonic()
        state = request.app[STATE]
        tenant = state.access.tenant_for(request)
        state.check_open()
        check_body_length(request.content_length, state.max_body_bytes)
        reservation = state.admit(tenant)  # before the body is read: a refusal costs nothing more
        try:
            body = await request.read()
            backend = state.backend
            if kind == "chat":
                parsed = await state.prompts.parse(tenant, body, protocol.parse_chat)
            else:
                vocab, max_len = backend.vocab_size, backend.max_model_len
                parsed = await state.prompts.parse(tenant, body, lambda b: protocol.parse_completion(b, vocab, max_len))
            state.route(parsed.req.model, tenant)  # 404 before the template or the tokenizer runs
            state.widen(reservation, parsed)  # a slot per sequence, before any work per prompt
            prompts = await state.prompts.of(kind, tenant, parsed)
            job = _job(state, kind, parsed, tenant, prompts, arrival)
            if job.adapter is not None:
                backend.offer_prompt(job.adapter, job.prompt)
            return await state.run(request, job, reservation)
        finally:
            state.release(reservation)  # already released (with its usage) once it ran: then nothing

    async def list_models(self, request: web.Request) -> web.Response:
        """The base and the adapters the tenant may use; one of its requests per minute."""
        state = request.app[STATE]
        tenant = state.access.tenant_for(request)
        state.release(state.admit(tenant))
        return web.Response(body=state.models.body(tenant), content_type="application/json")

    async def get_model(self, request: web.Request) -> web.Response:
        state = request.app[STATE]
        tenant = state.access.tenant_for(request)
        state.release(state.admit(tenant))
        model, adapter = state.route(request.match_info["model"], tenant)
        card = state.card_of(model, adapter)
        found = card.base() if adapter is None else card.adapter(model, tenant)
        return web.Response(body=msgspec.json.encode(found), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving; 503 once shutting down (a load balancer stops sending requests here)."""
        state = request.app[STATE]
        if state.closing:
            return web.json_response({"status": "shutting_down"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text; it names every tenant, so it takes a key unless started with --metrics-public."""
        state = request.app[STATE]
        if not state.metrics_public:
            state.access.require_metrics(request)
        return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def usage(self, request: web.Request) -> web.Response:
        """``GET /v1/usage`` (:mod:`lorapage.frontend.usage_route`) over every engine's ledger."""
        state = request.app[STATE]
        req = usage_request(state, request, request.query)
        rows = await state.backend.usage_rows(req.since_hour)
        body, content_type = await asyncio.to_thread(usage_answer, req, rows, dict(state.access.owners))
        charset = "utf-8" if content_type == "text/csv" else None
        return web.Response(body=body, content_type=content_type, charset=charset)


@web.middleware
async def count_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count answers by route and status (the route's pattern, so the label set stays small),
    judge a generation request's against its tenant's SLOs, and tell the backend (an admin
    route's change is mirrored into the other bases' engines). A request whose client went away
    counts with the status its stream had sent (:func:`~lorapage.frontend.access_log.status_when_cut`)."""
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        _counted(request, status_when_cut(request))
        raise
    _counted(request, response.status)
    return response


def _counted(request: web.Request, status: int) -> None:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    state = request.app[STATE]
    state.backend.after_request()
    state.metrics.requests.labels(route, str(status)).inc()
    job = request.get(JOB)
    if job is not None:
        state.record_slo(job, status)


async def _drain_on_shutdown(app: web.Application) -> None:
    """Stop taking requests, give running ones ``shutdown_grace_s`` to finish, then abort the rest."""
    state = app[STATE]
    state.closing = True
    try:
        await asyncio.wait_for(state.idle.wait(), timeout=state.shutdown_grace_s)
    except TimeoutError:
        log.warning("aborting %d requests still running after %.0fs", len(state.request_ids), state.shutdown_grace_s)
        for rid in list(state.request_ids):
            state.backend.abort(rid)
        try:
            await asyncio.wait_for(state.idle.wait(), timeout=5.0)
        except TimeoutError:
            pass


async def _start(app: web.Application) -> None:
    state = app[STATE]
    state.loop_lag.start()
    await state.backend.start()


async def _stop_workers(app: web.Application) -> None:
    state = app[STATE]
    await state.loop_lag.stop()
    state.prompts.workers.close()
    await state.backend.stop()


def build_app(
    backend: Backend,
    access: Access,
    add_routes: Callable[[web.Application], None],
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_grace_s: float = 10.0,
    metrics_public: bool = False,
    edge: EdgeLimits | None = None,
    access_log: AccessLog | None = None,
    slo_window_s: float = DEFAULT_WINDOW_S,
) -> web.Application:
    """The front end over ``backend``, to the tenants ``access`` knows: the OpenAI and vLLM routes,
    ``/health``, ``/metrics``, ``/v1/usage``; ``add_routes`` adds the side's own (admin, ...).

    ``access_log``: one JSON line per answered request (:mod:`lorapage.frontend.access_log`).
    ``/metrics`` takes the admin key or a ``[metrics]`` key unless ``metrics_public``. ``edge``
    bounds connections (header timeout, per-address cap) when served by
    :func:`~lorapage.frontend.run.start`. ``slo_window_s``: the sliding window of each tenant's
    goodput and burn-rate gauges.
    """
    stack: list[Middleware] = [count_middleware, error_middleware]
    if access_log is not None:
        stack.insert(0, access_log_middleware(access_log))
    app = web.Application(client_max_size=max_body_bytes, middlewares=stack)
    app[EDGE_LIMITS] = edge or EdgeLimits()
    app[STATE] = ServerState(
        backend,
        access,
        max_body_bytes=max_body_bytes,
        shutdown_grace_s=shutdown_grace_s,
        metrics_public=metrics_public,
        slo_window_s=slo_window_s,
    )
    app[BACKGROUND] = set()
    backend.set_tenant_weights(access.tenants.weights())  # VTC shares come from the tenants file
    routes = CoreRoutes()
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_get("/v1/models", routes.list_models)
    app.router.add_get("/v1/models/{model}", routes.get_model)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_get("/v1/usage", routes.usage)
    add_extra_routes(app)
    add_routes(app)
    app.on_startup.append(_start)
    app.on_shutdown.append(_drain_on_shutdown)
    app.on_cleanup.append(_stop_workers)
    if access_log is not None:

        async def _close_access_log(_: web.Application) -> None:
            access_log.close()

        app.on_cleanup.append(_close_access_log)
    return app

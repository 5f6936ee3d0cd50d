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
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from lorapage.adapters.names import parse_name
from lorapage.errors import (
    AdapterNotFoundError,
    EngineOverloadedError,
    QuotaExceededError,
    ServiceUnavailableError,
)
from lorapage.frontend import protocol
from lorapage.frontend.access_log import JOB, AccessLog, access_log_middleware, status_when_cut
from lorapage.frontend.auth import Access
from lorapage.frontend.backend import Backend
from lorapage.frontend.bodies import check_body_length
from lorapage.frontend.edge import EDGE_LIMITS, EdgeLimits
from lorapage.frontend.error_json import Handler, error_middleware
from lorapage.frontend.extra_routes import add_extra_routes
from lorapage.frontend.formatter import Formatter
from lorapage.frontend.generation import Job, Timing, answer, write_answer
from lorapage.frontend.job import make_job
from lorapage.frontend.loop_lag import LoopLagMonitor
from lorapage.frontend.metrics import CONTENT_TYPE
from lorapage.frontend.models_view import BaseCard
from lorapage.frontend.prompts import PromptBuilder, Prompts
from lorapage.frontend.state import AnswerWith, RouteState
from lorapage.frontend.usage_route import usage_answer, usage_request
from lorapage.tenancy.quota import AdmissionRate, QuotaExceeded, QuotaManager, Reservation
from lorapage.tenancy.slo import DEFAULT_WINDOW_S, SloTracker, request_outcome
from lorapage.tenancy.tenants import TenantsConfig

if TYPE_CHECKING:
    pass

log = logging.getLogger("lorapage.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_ADMISSION_WINDOW_S = 10  # recent admission rate, for the Retry-After of a 503


B = TypeVar("B", bound=Backend)


class ServerState(Generic[B]):
    """What the handlers share: who may use what, quotas, metrics, the requests in flight, and the
    :class:`~lorapage.frontend.backend.Backend` they run on (the engines here, or the fleet's replicas)."""

    def __init__(
        self,
        backend: B,
        access: Access,
        *,
        max_body_bytes: int,
        shutdown_grace_s: float,
        metrics_public: bool,
        slo_window_s: float = DEFAULT_WINDOW_S,
    ) -> None:
        self._backend = backend
        self.access = access
        # A tenant without max_concurrency may hold its share of the engines' queues, no more.
        self.quotas = QuotaManager(access.tenants, now=time.monotonic(), queue_len=backend.queue_len)
        self.admissions = AdmissionRate(_ADMISSION_WINDOW_S)  # requests that got their first output
        self.loop_lag = LoopLagMonitor()
        self.slo = SloTracker(access.tenants.slo_targets(), slo_window_s)
        self.metrics = backend.server_metrics(self.loop_lag, self.slo)
        self.prompts = PromptBuilder(backend.tokenizer, backend.max_model_len)
        self.max_body_bytes = max_body_bytes
        self.shutdown_grace_s = shutdown_grace_s
        self.metrics_public = metrics_public
        self.started = int(time.time())
        self.in_flight: Counter[str | None] = Counter()  # adapter version id@N (None: base) -> requests running
        self.request_ids: set[str] = set()  # the engine's ids of the requests in flight
        self.draining: set[str] = set()  # adapter versions (id@N) being deleted: invisible to new requests
        self.closing = False
        self.idle = asyncio.Event()
        self.idle.set()
        self.models = backend.models(access, self.started, self.draining)

    @property
    def backend(self) -> B:
        return self._backend

    def check_open(self) -> None:
        if self.closing:
            raise ServiceUnavailableError("the server is shutting down; retry on another replica", retry_after=5)

    def version_of(self, tenant: str, name: str) -> str | None:
        """The version key (``id@N``) ``name`` (``id`` or ``id@N``) serves for ``tenant`` now, or
        None when it does not exist, is being deleted or is not the tenant's. A version on
        another base raises its 409 (only to a tenant who may use the id)."""
        adapter_id, _ = parse_name(name)
        if not self.access.may_use(tenant, adapter_id):
            return None
        try:
            key = self.backend.version(name)
        except AdapterNotFoundError:
            return None
        return None if key in self.draining else key

    def route(self, model: str, tenant: str) -> tuple[str, str | None]:
        """``(id to echo, adapter version or None)`` for ``base``, ``base:adapter`` or
        ``adapter`` (each adapter as ``id`` or ``id@N``); else 404."""
        base = self.backend.base_named(model) or self.backend.base_name
        return protocol.route_model(model, base, lambda name: self.version_of(tenant, name))

    def card_of(self, model: str, adapter: str | None) -> BaseCard:
        """The card of the base ``model`` (resolved to ``adapter``, a version key or None) runs on."""
        backend = self.backend
        return self.models.card_named(backend.base_of(adapter) if adapter is not None else backend.base_named(model))

    def set_tenants(self, config: TenantsConfig) -> None:
        """An edited tenants file: keys, adapter lists, quotas (buckets keep their level, running
        requests their reservations), SLO targets and VTC shares."""
        self.access.tenants = config
        self.quotas.reload(config, now=time.monotonic())
        self.slo.set_targets(config.slo_targets())
        self.backend.set_tenant_weights(config.weights())

    def admit(self, tenant: str) -> Reservation:
        """Take one of the tenant's requests per minute and a concurrency slot before anything of
        the request is read (429 with Retry-After when it has none); :meth:`release` frees it."""
        got = self.quotas.admit(tenant, time.monotonic())
        if isinstance(got, QuotaExceeded):
            self.backend.record_rejected(tenant, 0, got.which)  # its size is not known yet
            raise QuotaExceededError(got.message, retry_after=got.retry_after_s)
        return got

    def release(self, reservation: Reservation, used_tokens: int = 0) -> None:
        self.quotas.release(reservation, used_tokens, time.monotonic())

    def widen(self, reservation: Reservation, parsed: protocol.Parsed) -> None:
        """Hold a concurrency slot per sequence of a decoded request (prompts x ``n``), before
        its prompts are tokenized (429 when the tenant has not that many free, without
        Retry-After when it never will)."""
        prompts, n = len(parsed.prompts), parsed.req.n or 1
        if prompts * n == 1:
            return
        refused = self.quotas.widen(reservation, prompts * n, f"{prompts} prompts x n {n}")
        if refused is not None:
            self.backend.record_rejected(reservation.tenant, 0, refused.which)
            raise QuotaExceededError(refused.message, retry_after=refused.retry_after_s)

    def charge(self, reservation: Reservation, job: Job) -> None:
        """Take the request's tokens (prompts, prompt-logprob rows, max_tokens per sequence) from
        its tenant's TPM (429 when short); an open-ended chat's budget is what the bucket holds."""
        now = time.monotonic()
        job.set_budget(self.quotas.room(reservation, job.prompt_work, now))
        refused = self.quotas.charge(reservation, job.prompt_work, job.completion_budget(), now)
        if refused is not None:
            self.record_rejected(job, refused.which)
            raise QuotaExceededError(refused.message, retry_after=refused.retry_after_s)

    def record_rejected(self, job: Job, reason: str) -> None:
        tokens = job.prompt_work + job.completion_budget()
        self.backend.record_rejected(job.tenant, tokens, reason)

    def record_slo(self, job: Job, status: int) -> None:
        """Judge an answered generation request against its tenant's SLOs: a 5xx (or a started
        stream's 5xx error event) failed it; a 4xx is the client's own and is not judged."""
        outcome = request_outcome(status, job.stream_error, job.ttft_s, job.mean_itl_s)
        if outcome is not None:
            self.slo.record(job.tenant, outcome, time.monotonic())

    async def run(
        self, request: web.Request, job: Job, reservation: Reservation, answer_with: AnswerWith | None = None
    ) -> web.StreamResponse:
        """Charge ``job``'s tokens, run it on the backend and answer it with ``answer_with`` (chat
        and completions' shapes by default; ``/v1/responses`` brings its own), counted in flight
        meanwhile."""
        self.charge(reservation, job)
        request[JOB] = job  # for the request log and the tenant's SLOs
        self.in_flight[job.adapter] += 1
        self.request_ids.add(job.engine_id)
        self.idle.clear()
        extra: dict[str, str] = {}
        outputs = self.backend.outputs(job, extra)
        try:
            timing = Timing(job, self.metrics, self.admissions)
            if answer_with is None:
                offload = functools.partial(self.prompts.workers.run, job.tenant)
                got = await answer(outputs, job, Formatter(job, self.backend.tokenizer, offload), timing)
            else:
                got = await answer_with(outputs, job, timing)
            got.headers.update(extra)
            return await write_answer(request, got)
        except EngineOverloadedError as exc:
            self.record_rejected(job, "queue_full")
            after = self.backend.overload_retry_after(self.admissions.per_second(time.monotonic()))
            if after is not None:
                exc.retry_after = after
            raise
        finally:
            # Ended here even when its answer never started (a client gone before the headers):
            # the engine's request stops, and what it computed is known before the refund.
            await outputs.aclose()
            # Refund what was not used: max_tokens not generated, and when it was cut (or refused)
            # before its first token, the prompt tokens the engine did not compute.
            used = job.prompt_work + job.generated if job.generated else job.prompt_computed
            self.release(reservation, used)
            self.request_ids.discard(job.engine_id)
            self.in_flight[job.adapter] -= 1
            if self.in_flight[job.adapter] <= 0:
                del self.in_flight[job.adapter]
            if not self.request_ids:
                self.idle.set()
            self.backend.finished(job)


STATE = web.AppKey("lorapage_state", ServerState)
if TYPE_CHECKING:  # mypy checks that ServerState is what the route modules are typed against
    _ROUTE_STATE: type[RouteState[Backend]] = ServerState


BACKGROUND = web.AppKey("lorapage_background", set)  # audit writes started by a signal


def _job(state: ServerState, kind: str, parsed: protocol.Parsed, tenant: str, prompts: Prompts, arrival: float) -> Job:
    # Resolved again: the adapter may have been deleted (or re-pointed) while the prompt was tokenized.
    model, adapter = state.route(parsed.req.model, tenant)
    backend = state.backend
    return make_job(
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


class CoreRoutes:
    """The OpenAI routes (chat, completions, models), health, metrics and usage: handlers over
    the front end's state (its key passed in, as every route module's is)."""

    def __init__(self, state_key: web.AppKey) -> None:
        self.key = state_key

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrival = time.monotonic()
        state = request.app[self.key]
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
        state = request.app[self.key]
        tenant = state.access.tenant_for(request)
        state.release(state.admit(tenant))
        return web.Response(body=state.models.body(tenant), content_type="application/json")

    async def get_model(self, request: web.Request) -> web.Response:
        state = request.app[self.key]
        tenant = state.access.tenant_for(request)
        state.release(state.admit(tenant))
        model, adapter = state.route(request.match_info["model"], tenant)
        card = state.card_of(model, adapter)
        found = card.base() if adapter is None else card.adapter(model, tenant)
        return web.Response(body=msgspec.json.encode(found), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving; 503 once shutting down (a load balancer stops sending requests here)."""
        state = request.app[self.key]
        if state.closing:
            return web.json_response({"status": "shutting_down"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text; it names every tenant, so it takes a key unless started with --metrics-public."""
        state = request.app[self.key]
        if not state.metrics_public:
            state.access.require_metrics(request)
        return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def usage(self, request: web.Request) -> web.Response:
        """``GET /v1/usage`` (:mod:`lorapage.frontend.usage_route`) over every engine's ledger."""
        state = request.app[self.key]
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
    routes = CoreRoutes(STATE)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_get("/v1/models", routes.list_models)
    app.router.add_get("/v1/models/{model}", routes.get_model)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_get("/v1/usage", routes.usage)
    add_extra_routes(app, STATE)
    add_routes(app)
    app.on_startup.append(_start)
    app.on_shutdown.append(_drain_on_shutdown)
    app.on_cleanup.append(_stop_workers)
    if access_log is not None:

        async def _close_access_log(_: web.Application) -> None:
            access_log.close()

        app.on_cleanup.append(_close_access_log)
    return app

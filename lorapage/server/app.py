"""The aiohttp application: OpenAI-compatible routes, health and metrics (admin routes: admin.py; vLLM's
extra routes and /v1/responses: extra_routes.py).

Every request is checked in the same order, cheapest first, and takes its tenant's quota before
any work that grows with its body: API key (401), declared body size (413), the tenant's
requests per minute and its share of concurrency (429; nothing of the body has been read yet),
the body read, decoded and checked (400; bounded in size, messages and nesting, decoded off the
event loop when big), model visibility (404), prompt length against the context (400: first a
bound on characters, then, off the event loop and in the tenant's turn, the template and the
tokenizer, which stop at the context), the tenant's tokens per minute (429); only then does the
engine see it (503 when its queue is full).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from lorapage.adapters.registry import parse_name
from lorapage.errors import (
    AdapterNotFoundError,
    BodyTooLargeError,
    EngineOverloadedError,
    QuotaExceededError,
    ServiceUnavailableError,
)
from lorapage.server import protocol
from lorapage.server.access_log import JOB, AccessLog, access_log_middleware
from lorapage.server.admin import add_admin_routes
from lorapage.server.audit_route import add_audit_routes
from lorapage.server.auth import Access
from lorapage.server.bases_route import add_base_routes
from lorapage.server.edge import EDGE_LIMITS, EdgeLimits
from lorapage.server.engines import Engines
from lorapage.server.error_json import Handler, error_middleware
from lorapage.server.extra_routes import add_extra_routes
from lorapage.server.generation import Job, make_job, respond
from lorapage.server.loop_lag import LoopLagMonitor
from lorapage.server.metrics import CONTENT_TYPE, BaseGauges, ServerMetrics
from lorapage.server.models_view import BaseCard, ModelsView
from lorapage.server.prompt_sampler import PromptSampler
from lorapage.server.prompts import PromptBuilder, Prompts
from lorapage.server.quota import AdmissionRate, QuotaExceeded, QuotaManager, Reservation, overload_retry_after_s
from lorapage.server.slo import DEFAULT_WINDOW_S, SloTracker, request_outcome
from lorapage.server.state import Responder, RouteState
from lorapage.server.tenants import TenantsConfig, TenantsConfigError
from lorapage.server.usage_route import add_usage_route

if TYPE_CHECKING:
    from lorapage.engine import Engine

log = logging.getLogger("lorapage.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_ADMISSION_WINDOW_S = 10  # recent admission rate, for the Retry-After of a 503


class ServerState:
    """What the handlers share: the engine, who may use what, metrics, and requests in flight.

    ``engine`` is the primary (its registry is the server's; admin routes act through it);
    ``engines`` holds it and the engines of the ``bases`` served beside it, and routes each request
    (:mod:`lorapage.server.engines`)."""

    def __init__(
        self,
        engine: Engine,
        access: Access,
        *,
        max_body_bytes: int,
        shutdown_grace_s: float,
        metrics_public: bool,
        slo_window_s: float = DEFAULT_WINDOW_S,
        bases: Sequence[Engine] = (),
    ) -> None:
        self.engine = engine
        self.engines = Engines([engine, *bases])
        self.access = access
        # Owners registered over the admin API survive restarts in the engine's registry.
        for adapter_id, owner in engine.admin.owners().items():
            access.set_owner(adapter_id, owner)
        # A tenant without max_concurrency may hold its share of the engine's queue, no more.
        self.quotas = QuotaManager(access.tenants, now=time.monotonic(), queue_len=engine.config.max_queue_len)
        self.admissions = AdmissionRate(_ADMISSION_WINDOW_S)  # requests that got their first output
        self.loop_lag = LoopLagMonitor()
        self.slo = SloTracker(access.tenants.slo_targets(), slo_window_s)
        seen = engine.metrics()
        self.metrics = ServerMetrics(
            seen.stats, seen.scheduler, seen.vtc_counters, loop_lag=self.loop_lag, adapters=seen.adapters, slo=self.slo
        )
        if self.engines.several:
            self.metrics.registry.register(BaseGauges([(e.base_name, e.digest, e.stats) for e in self.engines.engines]))
        self.prompts = PromptBuilder(engine.tokenizer, engine.max_model_len)
        # Check prompts sampled from the traffic of the adapters whose owners opted in.
        self.sampler = PromptSampler(engine.admin.registry.sampling_ids())
        self.sampler_task: asyncio.Task | None = None
        self.max_body_bytes = max_body_bytes
        self.shutdown_grace_s = shutdown_grace_s
        self.metrics_public = metrics_public
        self.started = int(time.time())
        self.in_flight: Counter[str | None] = Counter()  # adapter version id@N (None: base) -> requests running
        self.request_ids: set[str] = set()  # the engine's ids of the requests in flight
        self.draining: set[str] = set()  # adapter versions (id@N) being deleted: invisible to new requests
        self.closing = False
        self.background: set[asyncio.Task] = set()  # audit writes started by a signal
        self.idle = asyncio.Event()
        self.idle.set()
        self.card = BaseCard(
            engine.base_name, engine.max_model_len, self.started, serves_base=engine.merged_adapter is None
        )
        self.cards = {e.base_name: BaseCard(e.base_name, e.max_model_len, self.started) for e in bases}
        self._bases_of: dict[str, str] = {}  # adapter id -> the base it runs on (several bases), as last listed
        self.models = ModelsView(
            access,
            self.card,
            serving=self._serving_ids,
            key=lambda: (engine.admin.generation, frozenset(self.draining)),
            more_bases=list(self.cards.values()),
            base_of=self._bases_of.get,
        )

    def audit_later(self, action: str, *, after: dict | None = None, outcome: str = "ok") -> None:
        """Audit an action taken on a signal (``sighup``), committed off the loop; a failure to
        write it is logged, never raised into the signal handler."""

        async def record() -> None:
            try:
                await self.engine.admin.record(action, None, actor="sighup", after=after, outcome=outcome)
            except Exception:
                log.exception("the audit row of %s was not written", action)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called with no loop running (a script): the write needs the engine's loop
            log.warning("%s not audited: no event loop is running", action)
            return
        task = loop.create_task(record())
        self.background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self.background.discard)

    def _serving_ids(self) -> list[str]:
        merged = self.engine.merged_adapter
        if merged is not None:  # a dedicated deployment serves its one version
            return [merged.partition("@")[0]]
        if self.engines.several:
            self._bases_of.clear()
            self._bases_of.update(
                {i: base for i, (key, base) in self.engines.served_ids().items() if key not in self.draining}
            )
            return list(self._bases_of)
        versions = self.engine.admin.versions()
        return [v.adapter_id for v in versions if v.current and v.servable and v.key not in self.draining]

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
            key = self.engines.resolve(name)
        except AdapterNotFoundError:
            return None
        return None if key in self.draining else key

    def resolve(self, model: str, tenant: str) -> tuple[str, str | None]:
        """``(id to echo, adapter version or None)`` for ``base``, ``base:adapter`` or
        ``adapter`` (each adapter as ``id`` or ``id@N``); else 404."""
        base = next((n for n in self.cards if model == n or model.startswith(n + ":")), self.engine.base_name)
        return protocol.resolve_model(model, base, lambda name: self.version_of(tenant, name))

    def card_of(self, adapter: str | None) -> BaseCard:
        """The card of the base ``adapter`` (a version key; None: the primary) runs on."""
        if adapter is None or not self.engines.several:
            return self.card
        base = self.engines.base_of_key(adapter)
        return self.cards.get(base.name, self.card) if base is not None else self.card

    def admit(self, tenant: str) -> Reservation:
        """Take one of the tenant's requests per minute and a concurrency slot before anything of
        the request is read (429 with Retry-After when it has none); :meth:`release` frees it."""
        got = self.quotas.admit(tenant, time.monotonic())
        if isinstance(got, QuotaExceeded):
            self.engine.record_rejected(tenant, 0, got.which)  # its size is not known yet
            raise QuotaExceededError(got.message, retry_after=got.retry_after_s)
        return got

    def release(self, reservation: Reservation, used_tokens: int = 0) -> None:
        self.quotas.release(reservation, used_tokens, time.monotonic())

    def charge(self, reservation: Reservation, job: Job) -> None:
        """Take the request's tokens (prompt + max_tokens) from its tenant's TPM (429 when short)."""
        refused = self.quotas.charge(reservation, job.prompt_tokens, job.completion_budget(), time.monotonic())
        if refused is not None:
            self.record_rejected(job, refused.which)
            raise QuotaExceededError(refused.message, retry_after=refused.retry_after_s)

    def record_rejected(self, job: Job, reason: str) -> None:
        tokens = job.prompt_tokens + job.completion_budget()
        self.engine.record_rejected(job.tenant, tokens, reason)

    def record_slo(self, job: Job, status: int) -> None:
        """Judge an answered generation request against its tenant's SLOs: a 5xx (or a started
        stream's 5xx error event) failed it; a 4xx is the client's own and is not judged."""
        outcome = request_outcome(status, job.stream_error, job.ttft_s, job.mean_itl_s)
        if outcome is not None:
            self.slo.record(job.tenant, outcome, time.monotonic())

    def overload_retry_after(self) -> int:
        return overload_retry_after_s(
            self.engine.stats().queue_depth,
            self.engine.config.max_queue_len,
            self.admissions.per_second(time.monotonic()),
        )

    async def run(
        self, request: web.Request, job: Job, reservation: Reservation, responder: Responder = respond
    ) -> web.StreamResponse:
        """Charge ``job``'s tokens, run it and answer it with ``responder`` (chat and completions'
        shapes by default; ``/v1/responses`` brings its own), counted in flight meanwhile."""
        self.charge(reservation, job)
        request[JOB] = job  # for the request log and the tenant's SLOs
        self.in_flight[job.adapter] += 1
        self.request_ids.add(job.engine_id)
        self.idle.clear()
        try:
            engine = self.engines.engine_for(job.adapter, job.model)
            return await responder(request, engine, job, self.metrics, self.admissions)
        except EngineOverloadedError as exc:
            self.record_rejected(job, "queue_full")
            exc.retry_after = self.overload_retry_after()
            raise
        finally:
            # Refund what was not used: max_tokens not generated, and when it was cut (or refused)
            # before its first token, the prompt tokens the engine did not compute.
            used = job.prompt_tokens + job.generated if job.generated else job.prompt_computed
            self.release(reservation, used)
            self.request_ids.discard(job.engine_id)
            self.in_flight[job.adapter] -= 1
            if self.in_flight[job.adapter] <= 0:
                del self.in_flight[job.adapter]
            if not self.request_ids:
                self.idle.set()


STATE = web.AppKey("lorapage_state", ServerState)
if TYPE_CHECKING:  # mypy checks that ServerState is what the route modules are typed against
    _ROUTE_STATE: type[RouteState] = ServerState


def reload_tenants(app: web.Application, path: str) -> None:
    """Apply an edited tenants file (SIGHUP): new keys, adapter lists and quotas; a bad file is
    logged and the old one kept. Buckets keep their level and running requests their reservations."""
    state = app[STATE]
    try:
        config = TenantsConfig.load(path)
    except (OSError, TenantsConfigError) as exc:
        log.error("tenants file not reloaded, keeping the old one: %s", exc)
        state.audit_later("tenants_reload", outcome=f"refused: the file did not load ({type(exc).__name__})")
        return
    state.access.tenants = config
    state.quotas.reload(config, now=time.monotonic())
    state.slo.set_targets(config.slo_targets())
    state.engines.set_tenant_weights(config.weights())
    log.info("tenants file reloaded: %d tenants", len(config.tenants))
    state.audit_later("tenants_reload", after={"tenants": sorted(config.tenants)})


def check_length(request: web.Request) -> None:
    """413 for a body declared past the limit, before anything else is spent on it (one sent
    without a length is cut at the limit as it is read: aiohttp's ``client_max_size``)."""
    limit = request.app[STATE].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLargeError(f"request body is {request.content_length} bytes; the limit is {limit}")


def _job(state: ServerState, kind: str, parsed: protocol.Parsed, tenant: str, prompts: Prompts, arrival: float) -> Job:
    # Resolved again: the adapter may have been deleted (or re-pointed) while the prompt was tokenized.
    model, adapter = state.resolve(parsed.req.model, tenant)
    return make_job(
        kind,
        parsed,
        model,
        adapter,
        tenant,
        prompts.ids,
        state.engine.max_model_len,
        arrival,
        state.access,
        tools=prompts.tools,
        prompt_texts=prompts.texts,
        # A dedicated deployment runs its adapter on the base path, which the bound does not cover.
        max_adapter_tokens=state.engine.config.max_adapter_tokens if state.engine.merged_adapter is None else None,
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    tenant = state.access.tenant_for(request)
    state.check_open()
    check_length(request)
    reservation = state.admit(tenant)  # before the body is read: a refusal costs nothing more
    try:
        body = await request.read()
        engine = state.engine
        if kind == "chat":
            parsed = await state.prompts.parse(tenant, body, protocol.parse_chat)
        else:
            vocab, max_len = engine.model_config.vocab_size, engine.max_model_len
            parsed = await state.prompts.parse(tenant, body, lambda b: protocol.parse_completion(b, vocab, max_len))
        state.resolve(parsed.req.model, tenant)  # 404 before the template or the tokenizer runs
        prompts = await state.prompts.of(kind, tenant, parsed)
        job = _job(state, kind, parsed, tenant, prompts, arrival)
        if job.adapter is not None:
            state.sampler.offer(parse_name(job.adapter)[0], job.prompt)  # opted-in ids only: a set lookup
        return await state.run(request, job, reservation)
    finally:
        state.release(reservation)  # already released (with its usage) once it ran: then nothing


async def list_models(request: web.Request) -> web.Response:
    """The base and the adapters the tenant may use; one of its requests per minute."""
    state = request.app[STATE]
    tenant = state.access.tenant_for(request)
    state.release(state.admit(tenant))
    return web.Response(body=state.models.body(tenant), content_type="application/json")


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tenant = state.access.tenant_for(request)
    state.release(state.admit(tenant))
    model, adapter = state.resolve(request.match_info["model"], tenant)
    found = (
        state.cards.get(model, state.card).base() if adapter is None else state.card_of(adapter).adapter(model, tenant)
    )
    return web.Response(body=msgspec.json.encode(found), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.closing:
        return web.json_response({"status": "shutting_down"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text; it names every tenant, so it takes a key unless started with --metrics-public."""
    state = request.app[STATE]
    if not state.metrics_public:
        state.access.require_metrics(request)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


@web.middleware
async def count_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count answers by route and status (the route's pattern, so the label set stays small),
    judge a generation request's against its tenant's SLOs, and mirror what an admin route
    changed into the other bases' engines."""
    response = await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    state = request.app[STATE]
    try:
        state.engines.sync()  # an admin change reaches the other bases' engines now
    except Exception:  # never turn an answered (maybe committed) request into a 500: retried next request
        log.exception("mirroring the registry into the other bases' engines failed")
    state.metrics.requests.labels(route, str(response.status)).inc()
    job = request.get(JOB)
    if job is not None:
        state.record_slo(job, response.status)
    return response


async def _drain_on_shutdown(app: web.Application) -> None:
    """Stop taking requests, give running ones ``shutdown_grace_s`` to finish, then abort the rest."""
    state = app[STATE]
    state.closing = True
    try:
        await asyncio.wait_for(state.idle.wait(), timeout=state.shutdown_grace_s)
    except TimeoutError:
        log.warning("aborting %d requests still running after %.0fs", len(state.request_ids), state.shutdown_grace_s)
        for rid in list(state.request_ids):
            state.engines.abort(rid)
        try:
            await asyncio.wait_for(state.idle.wait(), timeout=5.0)
        except TimeoutError:
            pass


async def _restore_pins(app: web.Application) -> None:
    """Adapters pinned before a restart load now, not at the first request (on every base's engine)."""
    for engine in app[STATE].engines.engines:
        await engine.admin.restore_pins()


async def _start_loop_lag(app: web.Application) -> None:
    app[STATE].loop_lag.start()
    state = app[STATE]
    state.sampler_task = asyncio.get_running_loop().create_task(state.sampler.run(state.engine))


async def _stop_workers(app: web.Application) -> None:
    state = app[STATE]
    await state.loop_lag.stop()
    state.prompts.close()
    if state.sampler_task is not None:
        state.sampler_task.cancel()
        try:
            await state.sampler_task
        except asyncio.CancelledError:
            pass
    try:  # what was sampled since the last flush
        await state.sampler.flush(state.engine)
    except Exception:
        log.exception("storing sampled check prompts failed")


def create_app(
    engine: Engine,
    access: Access,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_grace_s: float = 10.0,
    metrics_public: bool = False,
    edge: EdgeLimits | None = None,
    access_log: AccessLog | None = None,
    slo_window_s: float = DEFAULT_WINDOW_S,
    bases: Sequence[Engine] = (),
) -> web.Application:
    """An aiohttp app serving ``engine`` to the tenants ``access`` knows. The caller owns the engine.

    ``bases``: engines of other bases served beside ``engine`` (the primary, whose registry is the
    server's), each request on its adapter version's base (:mod:`lorapage.server.engines`).

    ``access_log``: one JSON line per answered request (:mod:`lorapage.server.access_log`).
    ``/metrics`` takes the admin key or a ``[metrics]`` key unless ``metrics_public``. Admin
    registration reads adapter directories only under the engine's ``adapter_roots`` (an engine
    built to read any directory lets HTTP registration read none). ``edge`` bounds connections
    (header timeout, per-address cap) when served by :func:`~lorapage.server.run.start`.
    ``slo_window_s``: the sliding window of each tenant's goodput and burn-rate gauges.
    """
    middlewares = [count_middleware, error_middleware]
    if access_log is not None:
        middlewares.insert(0, access_log_middleware(access_log))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[EDGE_LIMITS] = edge or EdgeLimits()
    app[STATE] = ServerState(
        engine,
        access,
        max_body_bytes=max_body_bytes,
        shutdown_grace_s=shutdown_grace_s,
        metrics_public=metrics_public,
        slo_window_s=slo_window_s,
        bases=bases,
    )
    app[STATE].engines.set_tenant_weights(access.tenants.weights())  # VTC shares come from the tenants file
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_admin_routes(app, STATE)
    add_extra_routes(app, STATE)
    add_usage_route(app, STATE)
    add_audit_routes(app, STATE)
    add_base_routes(app, STATE)
    app.on_startup.append(_start_loop_lag)
    app.on_startup.append(_restore_pins)
    app.on_shutdown.append(_drain_on_shutdown)
    app.on_cleanup.append(_stop_workers)
    if access_log is not None:

        async def _close_access_log(_: web.Application) -> None:
            access_log.close()

        app.on_cleanup.append(_close_access_log)
    return app

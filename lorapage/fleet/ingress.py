"""The fleet's ingress: the OpenAI API of ``lorapage serve`` as a Ray Serve deployment.

Ray Serve's HTTP proxy hands each request to :meth:`FleetIngress.__call__` as a Starlette request.
The checks run in the order and with the shared code of the aiohttp server (``lorapage.server``:
auth, protocol, prompts, quotas, generation): API key (401), body size (413), JSON and fields
(400), model visibility (404), prompt length (400), quota (429). Then the request goes to an engine
replica through a deployment handle whose ``multiplexed_model_id`` is the adapter, so the
deployment's request router (:mod:`lorapage.fleet.request_router`) routes it by adapter affinity;
a version promoted to a dedicated merged deployment goes there instead
(:meth:`FleetIngress.engine_handle`, :mod:`lorapage.fleet.dedicated`).

Quotas are fleet-wide because this deployment runs exactly one replica and holds every tenant's
token buckets (a restart of it refills them, as a restart of ``lorapage serve`` does). It holds
the fleet's adapter registry too (:mod:`lorapage.fleet.registry`; the admin routes:
:mod:`lorapage.fleet.admin`) and resolves every request to one version ``id@N`` before it sends
it; replicas mirror the registry through their heartbeats (:meth:`FleetIngress.sync`), whose
stats and series ``/metrics`` and ``/internal/state`` re-export. ``--lora-modules`` are
registered in the registry (checked on a replica) before the first request is answered.

The ingress judges every generation request it answers against its tenant's SLOs (the
``lorapage_tenant_*`` series of ``lorapage serve``, on ``/metrics``) and, with ``--access-log``,
writes ``lorapage serve``'s request-log line for every answer (:mod:`lorapage.fleet.accounting`).
``GET /v1/usage`` asks every live replica for its usage ledger (one call each, in turn, routed
to it by id) and sums the rows before ``lorapage serve``'s filtering and answer.

An edited tenants file reaches the ingress as :meth:`FleetIngress.reload_tenants` (``lorapage
fleet`` calls it on SIGHUP). With a state directory the accepted text is kept there, so an
ingress that Ray restarts keeps the reloaded keys rather than the file the fleet started with.

A replica that dies is restarted by Ray. A request it held that had sent nothing to its client
(every whole answer, and a stream before its first token) is sent again, to a live replica, up
to ``request_retries`` times; a stream already under way ends with a retryable ``error`` event
(``unavailable``) before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
from prometheus_client import Counter as MetricCounter
from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from lorapage.adapters.registry import REGISTRY_FILE, Registry, parse_name
from lorapage.adapters.state_lock import StateDirLock
from lorapage.errors import (
    AdapterNotFoundError,
    LorapageError,
    QuotaExceededError,
    ServiceUnavailableError,
)
from lorapage.fleet.accounting import RequestAccounting, until_end
from lorapage.fleet.admin import FleetAdmin
from lorapage.fleet.auto_promote import AutoPromoter
from lorapage.fleet.bases import FleetBases
from lorapage.fleet.config import FleetConfig
from lorapage.fleet.dedicated import DedicatedDeployments
from lorapage.fleet.http import error_response, internal_error, method_not_allowed, no_route, read_body
from lorapage.fleet.messages import EngineJob, EngineProfile, Heartbeat, ReplicaStart, SyncReply
from lorapage.fleet.prewarm import PREWARMS
from lorapage.fleet.registry import FleetRegistry
from lorapage.fleet.routing import replica_target
from lorapage.fleet.telemetry import ReplicaReports
from lorapage.model.tokenizer import Tokenizer
from lorapage.server import protocol, tokenization
from lorapage.server.access_log import AccessLog
from lorapage.server.auth import Access
from lorapage.server.error_json import log_refusal
from lorapage.server.generation import Answer, Formatter, Job, Timing, answer, chained, make_job
from lorapage.server.metrics import CONTENT_TYPE, ServerMetrics
from lorapage.server.models_view import BaseCard, ModelsView
from lorapage.server.prompts import PromptBuilder, Prompts
from lorapage.server.quota import AdmissionRate, QuotaExceeded, QuotaManager, Reservation
from lorapage.server.responses_api import ResponsesPlan, parse_responses
from lorapage.server.responses_output import answer_response, responses_job
from lorapage.server.slo import SloTracker
from lorapage.server.sse import SSE_HEADERS
from lorapage.server.tenants import TenantsConfig, TenantsConfigError
from lorapage.server.usage_route import usage_answer, usage_request
from lorapage.server.version import PING_BODY, version_body
from lorapage.tools import detect_format
from lorapage.usage.ledger import Key, Usage
from lorapage.usage.report import summed

log = logging.getLogger("lorapage.fleet")

REPLICA_HEADER = "x-lorapage-replica"  # which engine replica answered (Ray's replica id)
_RETRY_BACKOFF_S = 0.25  # before resending a request whose replica died (times the attempt)
_RAY_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # Ray's (or the client's) id, if safe to echo
_ADMISSION_WINDOW_S = 10
_USAGE_TIMEOUT_S = 10.0  # for one replica's usage rows (a replica Ray is replacing never answers)
# A route's handler, and how a job's engine outputs become its answer (generation.answer's role).
Handler = Callable[[Request], Awaitable[Response]]
AnswerWith = Callable[[AsyncGenerator[Any, None], Job, Timing], Awaitable[Answer]]
TENANTS_FILE = "fleet-tenants.json"  # the last tenants text a reload accepted, and the start file it replaced


class FleetIngress:
    """Auth, tenants, quotas and the OpenAI protocol in front of the engine replicas."""

    def __init__(self, engines: Any, config: FleetConfig, bases: Sequence[Any] = ()) -> None:
        self.engines = engines  # a DeploymentHandle to the EngineReplica deployment
        self.bases = FleetBases([engines, *bases])  # one deployment per base (--base), the primary's first
        self.config = config
        self.access = Access(TenantsConfig.from_toml(self._tenants_text()))
        # A tenant without max_concurrency may hold its share of the replicas' queues together.
        queue_len = config.engine.max_queue_len * config.replicas
        self.quotas = QuotaManager(self.access.tenants, now=time.monotonic(), queue_len=queue_len)
        # One writer per state dir: a second fleet (or server) on it fails to deploy, saying why.
        self._state_lock = StateDirLock(Path(config.state_dir)) if config.state_dir is not None else None
        state = Path(config.state_dir) / REGISTRY_FILE if config.state_dir is not None else ":memory:"
        self.registry = FleetRegistry(Registry(state))
        for adapter_id in self.registry.ids():  # owners registered over the admin API, restored
            if (owner := self.registry.owner(adapter_id)) is not None:
                self.access.set_owner(adapter_id, owner)
        self.reports = ReplicaReports(config.sync_period_s, time.monotonic)
        self.slo = SloTracker(self.access.tenants.slo_targets(), config.slo_window_s)
        self.metrics = ServerMetrics(slo=self.slo)  # the ingress's own series; the replicas' are re-exported
        # An access log the ingress cannot open fails its deployment, saying why (the CLI checks it first).
        self.accounting = RequestAccounting(self.slo, AccessLog(config.access_log) if config.access_log else None)
        self.metrics.registry.register(self.reports)
        self.rejected = MetricCounter(
            "lorapage_fleet_rejected_requests",
            "Requests the ingress refused for a fleet-wide quota, by tenant and limit (rpm, tpm, concurrency).",
            ("tenant", "reason"),
            registry=self.metrics.registry,
        )
        self.admissions = AdmissionRate(_ADMISSION_WINDOW_S)
        self.in_flight: Counter[str | None] = Counter()  # version id@N (None: base) -> requests running
        self.draining: set[str] = set()  # versions being deleted: invisible to new requests
        self.tokenizer = Tokenizer.from_dir(config.engine.model)
        self.started = int(time.time())
        self._profile: EngineProfile | None = None
        self._prompts: PromptBuilder | None = None
        self._models: ModelsView | None = None
        self._modules_lock = asyncio.Lock()
        self._modules_registered = not config.lora_modules
        # Promoted adapters' merged deployments (Serve applications of their own), and --auto-promote.
        self.dedicated = DedicatedDeployments(config, self.registry, self.profile)
        self.auto = AutoPromoter(self.dedicated, config.dedicated.interval_s) if config.dedicated.auto else None
        self.admin = FleetAdmin(
            access=self.access,
            registry=self.registry,
            engines=engines,
            reports=self.reports,
            profile=self.profile,
            in_flight=self.in_flight,
            draining=self.draining,
            adapter_roots=config.roots(),
            sync_period_s=config.sync_period_s,
            dedicated=self.dedicated,
        )
        self._tool_format = detect_format(self.tokenizer.chat_template)
        self._routes: dict[str, dict[str, Handler]] = {  # path -> method -> handler
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/completions": {"POST": self.completions},
            "/v1/responses": {"POST": self.responses},
            "/v1/models": {"GET": self.list_models},
            "/health": {"GET": self.health},
            "/metrics": {"GET": self.render_metrics},
            "/v1/usage": {"GET": self.usage},
            "/tokenize": {"POST": self.tokenize},
            "/detokenize": {"POST": self.detokenize},
            "/tokenizer_info": {"GET": self.tokenizer_info},
            "/version": {"GET": self.version},
            "/ping": {"GET": self.ping, "POST": self.ping},
        }

    async def __call__(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            response = await self._dispatch(request)
        except LorapageError as exc:
            log_refusal(request.method, request.url.path, request.client.host if request.client else None, exc)
            response = error_response(exc)
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, request.url.path)
            response = internal_error()
        route, status = self._route_label(request.url.path), response.status_code
        self.metrics.requests.labels(route, str(status)).inc()
        job: Job | None = getattr(request.state, "job", None)  # set by run(): a generation request

        def finished() -> None:
            self.accounting.finished(request.method, route, status, started, job)

        if isinstance(response, StreamingResponse):  # recorded when the stream ends
            response.body_iterator = until_end(response.body_iterator, finished)
        else:
            finished()
        return response

    def _route_label(self, path: str) -> str:
        """The route's pattern, as the server labels it, so the label set stays small."""
        if path in self._routes:
            return path
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}"
        return self.admin.route_pattern(path) or "unmatched"

    async def _dispatch(self, request: Request) -> Response:
        path = request.url.path
        handlers: dict[str, Handler]
        if path.startswith("/v1/models/"):
            handlers = {"GET": self.get_model}
        elif path in self._routes:
            handlers = self._routes[path]
        elif (admin := self.admin.route(path)) is not None:
            admin_handlers, name = admin
            if request.method not in admin_handlers:
                return method_not_allowed(", ".join(admin_handlers))
            handler = admin_handlers[request.method]
            if not self.admin.open_to_tenants(handler):
                self.access.require_admin(cast(Any, request))
            await self.ready()
            return await handler(request, name)
        else:
            return no_route(request.method, path, self.route_table())
        if request.method not in handlers:
            return method_not_allowed(", ".join(handlers))
        return await handlers[request.method](request)

    def route_table(self) -> list[tuple[str, str]]:
        """``(method, pattern)`` of every route the ingress serves (what a 404 suggests from)."""
        own = [(method, path) for path, handlers in self._routes.items() for method in handlers]
        return [*own, ("GET", "/v1/models/{model}"), *self.admin.route_table()]

    # -- the fleet's own state --------------------------------------------------------------------

    async def ready(self) -> list[str]:
        """Register ``--lora-modules`` in the fleet's registry (once; each checked on a replica):
        same content is the same version, new content a new one, as ``lorapage serve`` does at
        each start. Returns the adapter ids."""
        if self._modules_registered:  # every request asks: no lock once done
            return self.registry.ids()
        async with self._modules_lock:
            for name, path in self.config.lora_modules if not self._modules_registered else ():
                got = await self.engines.options(multiplexed_model_id=name).prepare_adapter.remote(path, None, None)
                if isinstance(got, LorapageError):
                    raise got
                await asyncio.to_thread(self.registry.add, name, None, got, activate=True)
            self._modules_registered = True
        return self.registry.ids()

    async def sync(self, beat: Heartbeat) -> SyncReply:
        """A replica's heartbeat: recorded, and answered with what it must mirror."""
        self.reports.record(beat)
        self.dedicated.ensure_adopted()  # a restarted ingress takes over the merged deployments running
        if self.auto is not None:  # heartbeats never stop: the rules are judged with traffic or without
            self.auto.ensure_running()
        reply = self.registry.changes_since(beat.epoch, beat.generation, self.access.tenants.weights())
        prewarms = PREWARMS.take(beat.replica_id)
        return dataclasses.replace(reply, prewarms=prewarms) if prewarms else reply

    def reload_tenants(self, text: str) -> str:
        """Apply an edited tenants file: keys, adapter lists, quotas (buckets keep their level)
        and VTC shares (at the replicas' next heartbeat); a bad file changes nothing. Returns
        what happened, for the caller's log."""
        try:
            config = TenantsConfig.from_toml(text, source="the reloaded tenants file")
        except TenantsConfigError as exc:
            self._audit_reload(outcome=f"refused: the file did not load ({type(exc).__name__})")
            return f"tenants file not reloaded, keeping the old one: {exc}"
        self.access.tenants = config
        self.quotas.reload(config, now=time.monotonic())
        self.slo.set_targets(config.slo_targets())
        if self.config.state_dir is not None:
            record = {"origin": _sha256(self.config.tenants_toml), "text": text}
            target = Path(self.config.state_dir) / TENANTS_FILE
            target.parent.mkdir(parents=True, exist_ok=True)
            temp = target.with_suffix(".tmp")
            temp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(temp, target)
        self._audit_reload(after={"tenants": sorted(config.tenants)})
        return f"tenants file reloaded: {len(config.tenants)} tenants"

    def _audit_reload(self, *, after: dict | None = None, outcome: str = "ok") -> None:
        """Audit a reload as ``lorapage serve`` audits its SIGHUP (the fleet's CLI calls
        :meth:`reload_tenants` on one); a failure to write the row is logged, not raised."""
        try:
            self.registry.record("tenants_reload", None, actor="sighup", after=after, outcome=outcome)
        except Exception:
            log.exception("the audit row of a tenants reload was not written")

    def _tenants_text(self) -> str:
        """The tenants text a reload accepted for this fleet's start file, else the start file."""
        if self.config.state_dir is not None:
            try:
                record = json.loads((Path(self.config.state_dir) / TENANTS_FILE).read_text(encoding="utf-8"))
                if record.get("origin") == _sha256(self.config.tenants_toml):
                    return str(record["text"])
            except (OSError, ValueError):
                pass
        return self.config.tenants_toml

    async def render_metrics(self, request: Request) -> Response:
        """Prometheus text: the ingress's series and every live replica's, labelled ``replica``."""
        if not self.config.metrics_public:
            self.access.require_metrics(cast(Any, request))
        return Response(self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def usage(self, request: Request) -> Response:
        """``GET /v1/usage``: every live replica's ledger (the dedicated deployments' too), summed
        by (hour, tenant, adapter version), answered as ``lorapage serve`` answers it; 503 when a
        replica does not report."""
        req = usage_request(self.access, cast(Any, request), request.query_params)
        # One replica after another: two calls at once under one request's id left the second unrouted (outputs()).
        parts = [await self._replica_usage(rid, req.since_hour) for rid in self.reports.live()]
        parts += await self.dedicated.usage_parts(req.since_hour)  # promoted adapters' merged replicas
        body, content_type = usage_answer(req, summed(parts), self.access.owners)
        return Response(body, media_type=content_type)

    async def _replica_usage(self, replica_id: str, since_hour: int | None) -> list[tuple[Key, Usage]]:
        beat = self.reports.live().get(replica_id)
        deployment = self.bases.handle_of(beat.base_digest if beat is not None else "")  # its base's (--base)
        handle = deployment.options(multiplexed_model_id=replica_target(replica_id))
        try:
            return await asyncio.wait_for(handle.usage_rows.remote(since_hour), _USAGE_TIMEOUT_S)
        except (TimeoutError, RayActorError):
            raise ServiceUnavailableError(
                f"engine replica {replica_id} did not report its usage (it may be restarting); retry", retry_after=5
            ) from None

    # -- what the engines are ---------------------------------------------------------------------

    async def profile(self) -> EngineProfile:
        """The engines' base name and context, asked of a replica once (they all run one config)."""
        if self._profile is None:
            self._profile = await self.engines.profile.remote()
        return self._profile

    async def prompts(self) -> PromptBuilder:
        if self._prompts is None:
            self._prompts = PromptBuilder(self.tokenizer, (await self.profile()).max_model_len)
        return self._prompts

    def version_of(self, tenant: str, name: str, base_digest: str) -> str | None:
        """The version key (``id@N``) ``name`` (``id`` or ``id@N``) serves for ``tenant`` now, or
        None when it does not exist, is being deleted or is not the tenant's; a version on
        another base raises its 409 (only to a tenant who may use the id)."""
        adapter_id, _ = parse_name(name)
        if not self.access.may_use(tenant, adapter_id):
            return None
        try:
            key = self.bases.resolve(self.registry, name, base_digest)
        except AdapterNotFoundError:
            return None
        return None if key in self.draining else key

    async def resolve(self, model: str, tenant: str) -> tuple[str, str | None]:
        """``(id to echo, adapter version or None)``, as ``lorapage serve`` resolves it; else 404."""
        await self.ready()
        profile = await self.profile()
        await self.bases.served()
        return protocol.resolve_model(
            model,
            self.bases.named(model) or profile.base_name,
            lambda name: self.version_of(tenant, name, profile.base_digest),
        )

    # -- routes -----------------------------------------------------------------------------------

    def tenant(self, request: Request) -> str:
        # Access reads only the request's headers, which Starlette's request has too.
        return self.access.tenant_for(cast(Any, request))

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def _generate(self, request: Request, kind: str) -> Response:
        """One request, checked as ``lorapage serve`` checks it: its tenant's rate and share taken
        before its body is read, then the body, the model, the prompt (in the tenant's turn) and
        its tokens."""
        arrival = time.monotonic()
        tenant = self.tenant(request)
        reservation = self.admit(tenant)
        try:
            body = await self.body(request)
            profile, prompts = await self.profile(), await self.prompts()
            if kind == "chat":
                parsed = await prompts.parse(tenant, body, protocol.parse_chat)
            else:
                vocab, max_len = profile.vocab_size, profile.max_model_len
                parsed = await prompts.parse(tenant, body, lambda b: protocol.parse_completion(b, vocab, max_len))
            await self.resolve(parsed.req.model, tenant)  # 404 before the template or the tokenizer runs
            job = await self._job(kind, request, parsed, tenant, await prompts.of(kind, tenant, parsed), arrival)
            return await self.run(request, job, reservation)
        except BaseException:
            self.quotas.release(reservation, 0, time.monotonic())  # nothing when run() released it already
            raise

    async def _job(
        self, kind: str, request: Request, parsed: protocol.Parsed, tenant: str, prompts: Prompts, arrival: float
    ) -> Job:
        model, adapter = await self.resolve(parsed.req.model, tenant)
        max_len = (await self.profile()).max_model_len
        # Ray's proxy answers with the x-request-id it gave the request (or the client sent): the
        # body's id ends with it, so a client's and Ray's logs name the same request.
        ray_id = request.headers.get("x-request-id", "")
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{ray_id}" if _RAY_REQUEST_ID.match(ray_id) else ""
        # Only echoed: the engine's id is the job's own (a client's could name another tenant's request).
        return make_job(
            kind, parsed, model, adapter, tenant, prompts.ids, max_len, arrival, self.access, rid,
            tools=prompts.tools, prompt_texts=prompts.texts,
            # a version served merged is outside the shared pool's bound on adapter traffic
            max_adapter_tokens=None if self.dedicated.route(adapter) else self.config.engine.max_adapter_tokens,
        )  # fmt: skip

    async def models(self) -> ModelsView:
        """The per-tenant ``/v1/models`` view over the fleet's registry (built once the engines' profile is known)."""
        if self._models is None:
            profile = await self.profile()
            card = BaseCard(profile.base_name, profile.max_model_len, self.started)
            more = [BaseCard(b.name, profile.max_model_len, self.started) for b in (await self.bases.served())[1:]]

            def serving() -> list[str]:
                return [i for i in self.registry.ids() if self.version_of_any(i, profile.base_digest)]

            def base_of(adapter_id: str) -> str | None:
                key = self.bases.resolve(self.registry, adapter_id, profile.base_digest)
                base = self.bases.base_of(self.registry, key)
                return base.name if base is not None else None

            self._models = ModelsView(
                self.access,
                card,
                serving=serving,
                key=lambda: (self.registry.generation, frozenset(self.draining)),
                more_bases=more,
                base_of=base_of if self.bases.several else None,
            )
        return self._models

    def version_of_any(self, adapter_id: str, base_digest: str) -> bool:
        """Whether ``adapter_id`` serves a version on this base now (whoever asks)."""
        try:
            return self.bases.resolve(self.registry, adapter_id, base_digest) not in self.draining
        except LorapageError:  # none, or one validated against another base
            return False

    async def list_models(self, request: Request) -> Response:
        """The base and the adapters the tenant may use; one of its requests per minute."""
        tenant = self.tenant(request)
        self.quotas.release(self.admit(tenant), 0, time.monotonic())
        await self.ready()
        return Response((await self.models()).body(tenant), media_type="application/json")

    async def get_model(self, request: Request) -> Response:
        tenant = self.tenant(request)
        self.quotas.release(self.admit(tenant), 0, time.monotonic())
        model, adapter = await self.resolve(request.url.path.removeprefix("/v1/models/"), tenant)
        view = await self.models()
        base = self.bases.base_of(self.registry, adapter) if adapter is not None else None
        card = view.card_named(base.name if base is not None else self.bases.named(model))
        found = card.base() if adapter is None else card.adapter(model, tenant)
        return Response(msgspec.json.encode(found), media_type="application/json")

    async def health(self, request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    # -- vLLM's extra routes and /v1/responses (lorapage.server.extra_routes is lorapage serve's) --

    async def tokenize(self, request: Request) -> Response:
        return await self._tokenizer_route(request, tokenization.tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokenizer_route(request, tokenization.detokenize)

    async def _tokenizer_route(self, request: Request, route: Any) -> Response:
        """``/tokenize`` or ``/detokenize``: one of the tenant's requests per minute, the body, the work."""
        tenant = self.tenant(request)
        reservation = self.admit(tenant)
        try:
            body = await self.body(request)

            async def resolve(model: str) -> object:
                return await self.resolve(model, tenant)

            return Response(msgspec.json.encode(await route(await self.prompts(), tenant, body, resolve)))
        finally:
            self.quotas.release(reservation, 0, time.monotonic())

    async def tokenizer_info(self, request: Request) -> Response:
        tenant = self.tenant(request)
        self.quotas.release(self.admit(tenant), 0, time.monotonic())
        info = tokenization.tokenizer_info(await self.prompts())
        return Response(msgspec.json.encode(info), media_type="application/json")

    async def version(self, request: Request) -> Response:
        return Response(version_body(), media_type="application/json")

    async def ping(self, request: Request) -> Response:
        return Response(PING_BODY)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``, checked as ``lorapage serve`` checks it, run like a chat completion."""
        arrival = time.monotonic()
        tenant = self.tenant(request)
        reservation = self.admit(tenant)
        try:
            body = await self.body(request)
            profile, prompts = await self.profile(), await self.prompts()
            template, fmt = self.tokenizer.chat_template, self._tool_format
            parsed = await prompts.parse(tenant, body, lambda b: parse_responses(b, template, fmt))
            plan: ResponsesPlan = parsed.req
            await self.resolve(plan.req.model, tenant)  # 404 before the template or the tokenizer runs
            ids = await prompts.chat_tokens(tenant, plan.messages, template_kwargs=plan.template_kwargs)
            model, adapter = await self.resolve(plan.req.model, tenant)
            job = responses_job(plan, model, adapter, tenant, ids, profile.max_model_len, arrival, self.access)
            return await self.run(
                request, job, reservation, lambda outputs, job, timing: answer_response(outputs, job, plan, timing)
            )
        except BaseException:
            self.quotas.release(reservation, 0, time.monotonic())  # nothing when run() released it already
            raise

    # -- running a request on the engines ---------------------------------------------------------

    def admit(self, tenant: str) -> Reservation:
        """The tenant's rate and its share of concurrency, before anything of the request is read."""
        got = self.quotas.admit(tenant, time.monotonic())
        if isinstance(got, QuotaExceeded):
            self.rejected.labels(tenant, got.which).inc()
            raise QuotaExceededError(got.message, retry_after=got.retry_after_s)
        return got

    def charge(self, job: Job, reservation: Reservation) -> None:
        """The request's tokens from its tenant's TPM (429 when short); then it counts as in flight."""
        refused = self.quotas.charge(reservation, job.prompt_tokens, job.completion_budget(), time.monotonic())
        if refused is not None:
            self.rejected.labels(job.tenant, refused.which).inc()
            raise QuotaExceededError(refused.message, retry_after=refused.retry_after_s)
        self.in_flight[job.adapter] += 1

    def release(self, job: Job, reservation: Reservation) -> None:
        # Refund what was not used: max_tokens not generated, and the prompt when no replica took it.
        used = job.prompt_tokens + job.generated if job.generated else job.prompt_computed
        self.quotas.release(reservation, used, time.monotonic())
        self.in_flight[job.adapter] -= 1
        if not self.in_flight[job.adapter]:
            del self.in_flight[job.adapter]
        if self.auto is not None:
            self.auto.observe(job.adapter, job.generated)

    async def run(
        self, request: Request, job: Job, reservation: Reservation, answer_with: AnswerWith | None = None
    ) -> Response:
        """Charge ``job``'s tokens, run it on a replica and answer it with ``answer_with`` (chat
        and completions' shapes by default; ``/v1/responses`` brings its own)."""
        self.charge(job, reservation)
        request.state.job = job  # for its tenant's SLOs and the access log (as lorapage serve's request[JOB])
        served: list[str] = []  # the replica that took it (the last, after a retry)
        timing = Timing(job, self.metrics, self.admissions)
        try:
            outputs = self.outputs(job, served)
            if answer_with is None:
                got = await answer(outputs, job, Formatter(job, self.tokenizer), timing)
            else:
                got = await answer_with(outputs, job, timing)
        except BaseException:
            self.release(job, reservation)
            raise
        # x-request-id is the proxy's to write (it always does); a second one would be ambiguous.
        headers = {k: v for k, v in got.headers.items() if k != "x-request-id"}
        headers[REPLICA_HEADER] = served[-1] if served else "none"
        if got.events is None:
            self.release(job, reservation)
            return Response(got.body, media_type="application/json", headers=headers)
        return StreamingResponse(
            self._stream(got.events, job, reservation), headers={**SSE_HEADERS, **headers}, media_type=None
        )

    async def _stream(
        self, events: AsyncGenerator[bytes, None], job: Job, reservation: Reservation
    ) -> AsyncGenerator[bytes, None]:
        try:
            async for data in events:
                yield data
        finally:
            await events.aclose()
            self.release(job, reservation)

    def engine_handle(self, job: Job) -> Any:
        """The deployment ``job`` goes to: its adapter version's dedicated (merged) deployment when
        it is promoted, else its base's engine deployment (``--base``: fleet/bases.py), routed by
        adapter id: every version of an id shares its owners (a deploy lands where the previous
        version is warm)."""
        merged = self.dedicated.route(job.adapter)
        if merged is not None:
            return merged
        handle = self.bases.handle_for(self.registry, job.adapter, job.model)
        return handle.options(multiplexed_model_id=parse_name(job.adapter)[0] if job.adapter is not None else "")

    def outputs(self, job: Job, served: list[str]) -> AsyncGenerator[Any, None]:
        """The engine outputs of every prompt of ``job``, as one stream (each prompt routed on its
        own). One after another: Ray Serve gives the calls a request makes its own request id, and
        two at once under one id left the second unrouted."""
        return chained([self.prompt_outputs(job, served, i) for i in range(len(job.prompts))], job.sampling.n)

    async def prompt_outputs(self, job: Job, served: list[str], i: int) -> AsyncGenerator[Any, None]:
        """The engine outputs of ``job``'s prompt ``i`` from a replica the router picks; resent while
        nothing of it has been passed on. A whole answer passes on only its last outputs, so it can
        always be resent."""
        prompt = job.prompts[i]
        spec = EngineJob(prompt, job.adapter, job.sampling, job.tenant, job.engine_ids()[i], job.prefix_group)
        counted = 0  # of this prompt's tokens, in job.prompt_computed
        for attempt in range(self.config.request_retries + 1):
            passed_on = False
            # chosen again on a resend: the adapter may have been promoted or demoted meanwhile
            stream = self.engine_handle(job).options(stream=True).generate.remote(spec)
            try:
                async for item in stream:
                    if isinstance(item, ReplicaStart):
                        served.append(item.replica_id)
                        job.adapter_version = item.adapter_version
                        # What the replica computes does not come back when the client cuts the
                        # stream: once a replica has taken the request, its whole prompt counts.
                        job.prompt_computed += len(prompt) - counted
                        counted = len(prompt)
                    elif isinstance(item, LorapageError):
                        job.prompt_computed -= counted  # refused: nothing was computed
                        counted = 0
                        raise item
                    elif job.stream or item.finished:
                        passed_on = True
                        yield item
                    elif item.token_ids and job.first_token_at is None:  # a whole answer's TTFT: when it came
                        job.first_token_at = time.monotonic()
                return
            except RayActorError:
                job.prompt_computed -= counted  # resent: the next replica's start counts it again
                counted = 0
                if not passed_on and i == 0:
                    job.first_token_at = None  # nothing was answered: the resent request's first token counts
                if passed_on:
                    raise ServiceUnavailableError(
                        "the engine replica serving this request stopped mid-answer; send the request again",
                        retry_after=1,
                    ) from None
                log.warning("replica %s died before answering %s; resending", served[-1:], job.request_id)
            finally:
                stream.cancel()
            await asyncio.sleep(_RETRY_BACKOFF_S * (attempt + 1))
        raise ServiceUnavailableError(
            f"no engine replica could answer after {self.config.request_retries + 1} attempts; retry later",
            retry_after=5,
        )


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()

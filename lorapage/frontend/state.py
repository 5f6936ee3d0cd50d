"""The front end's state, what every route handler shares: who may use what, quotas, metrics,
the requests in flight, and the :class:`~lorapage.frontend.backend.Backend` they run on (the
engines here, or the fleet's replicas); the app holds it under :data:`STATE`. Route modules
import it from here; :mod:`lorapage.frontend.app` builds the app around it."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from aiohttp import web

from lorapage.adapters.names import parse_name
from lorapage.errors import (
    AdapterNotFoundError,
    EngineOverloadedError,
    QuotaExceededError,
    ServiceUnavailableError,
)
from lorapage.frontend import protocol
from lorapage.frontend.access_log import JOB
from lorapage.frontend.auth import Access
from lorapage.frontend.backend import Backend
from lorapage.frontend.formatter import Formatter
from lorapage.frontend.generation import Answer, Job, Timing, answer, write_answer
from lorapage.frontend.loop_lag import LoopLagMonitor
from lorapage.frontend.models_view import BaseCard
from lorapage.frontend.prompts import PromptBuilder
from lorapage.request import TokenStream
from lorapage.tenancy.quota import AdmissionRate, QuotaExceeded, QuotaManager, Reservation
from lorapage.tenancy.slo import DEFAULT_WINDOW_S, SloTracker, request_outcome
from lorapage.tenancy.tenants import TenantsConfig

_ADMISSION_WINDOW_S = 10  # recent admission rate, for the Retry-After of a 503
# How a job's engine outputs become its answer (generation.answer's role; /v1/responses brings its own).
AnswerWith = Callable[[TokenStream, Job, Timing], Awaitable[Answer]]

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
        self.prompts = PromptBuilder(
            backend.tokenizer, backend.max_model_len, tool_call_parser=backend.tool_call_parser
        )
        self.reasoning_parser = backend.reasoning_parser
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

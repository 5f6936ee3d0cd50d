"""The fleet's backend: where the one front end (:mod:`lorapage.frontend.app`) sends requests in a fleet.

A :class:`~lorapage.frontend.backend.Backend` over deployment handles: every request resolved to one
version ``id@N`` in the fleet's registry (:mod:`lorapage.fleet.registry`) goes to an engine replica
through a handle whose ``multiplexed_model_id`` is the adapter, so the deployment's request router
(:mod:`lorapage.fleet.request_router`) routes it by adapter affinity; a version promoted to a
dedicated merged deployment goes there instead (:meth:`FleetBackend.engine_handle`,
:mod:`lorapage.fleet.dedicated`); with ``--base``, the deployment of the base its version is bound
to (:mod:`lorapage.fleet.bases`).

A replica that dies is restarted by Ray. A request it held that had sent nothing to its client
(every whole answer, and a stream before its first token) is sent again, to a live replica, up to
``request_retries`` times; a stream already under way ends with a retryable ``error`` event
(``unavailable``) before ``[DONE]``.

``/metrics`` re-exports the replicas' heartbeat series (:mod:`lorapage.fleet.telemetry`) beside the
front end's own; ``GET /v1/usage`` asks every live replica (and every dedicated deployment) for its
usage ledger, one call each in turn, routed to it by id, and sums the rows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter as MetricCounter
from ray.exceptions import RayActorError

from lorapage.adapters.names import parse_name
from lorapage.errors import AdapterEnvelopeError, LorapageError, ServiceUnavailableError
from lorapage.fleet.auto_promote import AutoPromoter
from lorapage.fleet.bases import FleetBases
from lorapage.fleet.config import FleetConfig
from lorapage.fleet.dedicated import DedicatedDeployments
from lorapage.fleet.messages import EngineJob, EngineProfile, ReplicaStart
from lorapage.fleet.registry import FleetRegistry
from lorapage.fleet.routing import replica_target
from lorapage.fleet.telemetry import ReplicaReports
from lorapage.frontend.auth import Access
from lorapage.frontend.generation import Job, chained
from lorapage.frontend.metrics import ServerMetrics
from lorapage.frontend.models_view import BaseCard, ModelsView
from lorapage.model.tokenizer import Tokenizer
from lorapage.request import TokenStream
from lorapage.tenancy.slo import SloTracker
from lorapage.usage.ledger import Key, Usage
from lorapage.usage.report import summed

if TYPE_CHECKING:
    from lorapage.frontend.loop_lag import LoopLagMonitor

log = logging.getLogger("lorapage.fleet")

REPLICA_HEADER = "x-lorapage-replica"  # which engine replica answered (Ray's replica id)
_RETRY_BACKOFF_S = 0.25  # before resending a request whose replica died (times the attempt)
_USAGE_TIMEOUT_S = 10.0  # for one replica's usage rows (a replica Ray is replacing never answers)


class FleetBackend:
    """The engine deployments (``bases``: one per base, the primary's first), the fleet's registry,
    the replicas' reports and the dedicated deployments, as the front end's backend."""

    def __init__(
        self,
        config: FleetConfig,
        bases: FleetBases,
        profile: EngineProfile,
        registry: FleetRegistry,
        reports: ReplicaReports,
        dedicated: DedicatedDeployments,
        auto: AutoPromoter | None,
    ) -> None:
        self.config, self.bases, self.profile = config, bases, profile
        self.registry, self.reports, self.dedicated, self.auto = registry, reports, dedicated, auto
        self.tokenizer = Tokenizer.from_dir(config.engine.model)
        self.base_name = profile.base_name
        self.max_model_len = profile.max_model_len
        self.vocab_size = profile.vocab_size
        self.tool_call_parser = config.engine.tool_call_parser
        self.reasoning_parser = config.engine.reasoning_parser
        self._streams: dict[str, Any] = {}  # engine request id -> its replica call (abort() cancels it)
        # A tenant without max_concurrency may hold its share of the replicas' queues together.
        self.queue_len = config.engine.max_queue_len * config.max_replicas()
        self.rejected: MetricCounter | None = None

    def server_metrics(self, loop_lag: LoopLagMonitor, slo: SloTracker) -> ServerMetrics:
        """The ingress's own series and every live replica's, labelled ``replica``."""
        metrics = ServerMetrics(loop_lag=loop_lag, slo=slo)
        metrics.registry.register(self.reports)
        self.rejected = MetricCounter(
            "lorapage_fleet_rejected_requests",
            "Requests the ingress refused, by tenant and reason (rpm, tpm, concurrency: a fleet-wide quota; "
            "queue_full: a replica's queue).",
            ("tenant", "reason"),
            registry=metrics.registry,
        )
        return metrics

    def models(self, access: Access, started: int, draining: Collection[str]) -> ModelsView:
        """The per-tenant ``/v1/models`` view over the fleet's registry."""
        card = BaseCard(self.base_name, self.max_model_len, started)
        more = [BaseCard(b.name, self.max_model_len, started) for b in self.bases.bases[1:]]

        def serving() -> list[str]:
            return [i for i in self.registry.index.ids() if self._serves(i, draining)]

        return ModelsView(
            access,
            card,
            serving=serving,
            key=lambda: (self.registry.generation, frozenset(draining)),
            more_bases=more,
            base_of=self._base_of_id if self.bases.several else None,
        )

    def _serves(self, adapter_id: str, draining: Collection[str]) -> bool:
        """Whether ``adapter_id`` serves a version on a served base now, not being deleted (whoever asks)."""
        try:
            return self.version(adapter_id) not in draining
        except LorapageError:  # none, or one validated against another base
            return False

    def _base_of_id(self, adapter_id: str) -> str | None:
        return self.base_of(self.version(adapter_id))

    def version(self, name: str) -> str:
        return self.bases.serving_key(self.registry, name)

    def base_named(self, model: str) -> str | None:
        return self.bases.named(model)

    def base_of(self, key: str) -> str | None:
        base = self.bases.base_of(self.registry, key)
        return base.name if base is not None else None

    def max_adapter_tokens(self, adapter: str | None) -> int | None:
        # a version served merged is outside the shared pool's bound on adapter traffic
        return None if self.dedicated.route(adapter) else self.config.engine.max_adapter_tokens

    def record_rejected(self, tenant: str, tokens: int, reason: str) -> None:
        if self.rejected is not None:
            self.rejected.labels(tenant, reason).inc()

    def overload_retry_after(self, admissions_per_s: float) -> int | None:
        return None  # the replica's refusal says when to retry

    def finished(self, job: Job) -> None:
        if self.auto is not None:
            self.auto.observe(job.adapter, job.generated)

    def offer_prompt(self, adapter: str, prompt: list[int]) -> None:
        pass  # a fleet keeps no sample of an adapter's traffic (its check prompts are given)

    def after_request(self) -> None:
        pass  # replicas mirror the registry through their heartbeats

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        pass  # replicas take the tenants' VTC shares from the next heartbeat reply

    def abort(self, request_id: str) -> None:
        """Cancel the replica call running engine request ``request_id`` (at shutdown, past the
        grace period): the replica aborts it, and its handler ends."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    # -- running a request on the replicas --------------------------------------------------------

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

    def outputs(self, job: Job, headers: dict[str, str]) -> TokenStream:
        """The engine outputs of every prompt of ``job``, as one stream (each prompt routed on its
        own); ``headers`` names the replica that took it (the last, after a retry). One after
        another: Ray Serve gives the calls a request makes its own request id, and two at once
        under one id left the second unrouted."""
        headers[REPLICA_HEADER] = "none"
        return chained([self.prompt_outputs(job, headers, i) for i in range(len(job.prompts))], job.sampling.n)

    async def prompt_outputs(self, job: Job, headers: dict[str, str], i: int) -> TokenStream:
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
            self._streams[spec.request_id] = stream
            try:
                async for item in stream:
                    if isinstance(item, ReplicaStart):
                        headers[REPLICA_HEADER] = item.replica_id
                        job.adapter_version = item.adapter_version
                        # What the replica computes does not come back when the client cuts the
                        # stream: once a replica has taken the request, its whole prompt counts.
                        job.prompt_computed += len(prompt) - counted
                        counted = len(prompt)
                    elif isinstance(item, LorapageError):
                        job.prompt_computed -= counted  # refused: nothing was computed
                        counted = 0
                        if self.auto is None or job.adapter is None or not isinstance(item, AdapterEnvelopeError):
                            raise item
                        await self.auto.first_use(job.adapter)  # --auto-promote: its deployment started, waited for
                        break
                    elif job.stream or item.finished:
                        passed_on = True
                        yield item
                    elif item.token_ids and job.first_token_at is None:  # a whole answer's TTFT: when it came
                        job.first_token_at = time.monotonic()
                else:
                    return
                continue  # promoted on first use: sent again at once, to its dedicated deployment
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
                log.warning("replica %s died before answering %s; resending", headers[REPLICA_HEADER], job.request_id)
            finally:
                stream.cancel()
                self._streams.pop(spec.request_id, None)
            await asyncio.sleep(_RETRY_BACKOFF_S * (attempt + 1))
        raise ServiceUnavailableError(
            f"no engine replica could answer after {self.config.request_retries + 1} attempts; retry later",
            retry_after=5,
        )

    # -- usage ------------------------------------------------------------------------------------

    async def usage_rows(self, since_hour: int | None) -> list[tuple[Key, Usage]]:
        """Every live replica's ledger (the dedicated deployments' too), summed by (hour, tenant,
        adapter version); 503 when a replica does not report."""
        # One replica after another: two calls at once under one request's id left the second unrouted (outputs()).
        parts = [await self._replica_usage(rid, since_hour) for rid in self.reports.live()]
        parts += await self.dedicated.usage_parts(since_hour)  # promoted adapters' merged replicas
        return summed(parts)

    async def _replica_usage(self, replica_id: str, since_hour: int | None) -> Sequence[tuple[Key, Usage]]:
        beat = self.reports.live().get(replica_id)
        deployment = self.bases.handle_of(beat.base_digest if beat is not None else "")  # its base's (--base)
        handle = deployment.options(multiplexed_model_id=replica_target(replica_id))
        try:
            return await asyncio.wait_for(handle.usage_rows.remote(since_hour), _USAGE_TIMEOUT_S)
        except (TimeoutError, RayActorError):
            raise ServiceUnavailableError(
                f"engine replica {replica_id} did not report its usage (it may be restarting); retry", retry_after=5
            ) from None

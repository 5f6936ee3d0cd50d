"""``lorapage serve``'s backend: the engines in this process, one per base (:mod:`lorapage.serve.engines`).

What the front end (:mod:`lorapage.frontend.app`) asks of where requests go
(:class:`~lorapage.frontend.backend.Backend`), answered by the primary engine and the engines of
the bases served beside it; plus what only an engine in this process has: the check prompts
sampled from traffic (:class:`~lorapage.frontend.prompt_sampler.PromptSampler`) and pins restored at
start. The admin, audit and base-upgrade routes reach the engines through their own operations
(:class:`~lorapage.serve.local_admin.LocalDeployment`, :class:`~lorapage.frontend.bases_route.LocalUpgrades`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from lorapage.adapters.names import parse_name
from lorapage.errors import AdapterEnvelopeError
from lorapage.frontend.auth import Access
from lorapage.frontend.generation import Job, engine_outputs
from lorapage.frontend.metrics import BaseGauges, ServerMetrics
from lorapage.frontend.models_view import BaseCard, ModelsView
from lorapage.frontend.prompt_sampler import PromptSampler
from lorapage.request import PromptProgress, TokenStream
from lorapage.serve.dedicated import LocalDedicated
from lorapage.serve.engines import Engines
from lorapage.tenancy.quota import overload_retry_after_s
from lorapage.tenancy.slo import SloTracker
from lorapage.usage.ledger import Key, Usage
from lorapage.usage.report import summed

if TYPE_CHECKING:
    from lorapage.engine import Engine
    from lorapage.frontend.loop_lag import LoopLagMonitor

log = logging.getLogger("lorapage.server")


class EngineBackend:
    """The primary ``engine`` (its registry is the server's), the engines of ``bases`` beside it,
    and the merged engines of the adapters promoted (``dedicated``, :mod:`lorapage.serve.dedicated`)."""

    def __init__(self, engine: Engine, bases: Sequence[Engine] = (), dedicated: LocalDedicated | None = None) -> None:
        self.engine = engine
        self.engines = Engines([engine, *bases])
        self.dedicated = dedicated or LocalDedicated(engine)
        self.tokenizer = engine.tokenizer
        self.base_name = engine.base_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.queue_len = engine.config.max_queue_len
        self.tool_call_parser = engine.config.tool_call_parser
        self.reasoning_parser = engine.config.reasoning_parser
        # Check prompts sampled from the traffic of the adapters whose owners opted in.
        self.sampler = PromptSampler(engine.admin.catalog.drift_record.sampling_ids())
        self.sampler_task: asyncio.Task | None = None
        self._bases_of: dict[str, str] = {}  # adapter id -> the base it runs on (several bases), as last listed
        self._side_names = [e.base_name for e in bases]

    def server_metrics(self, loop_lag: LoopLagMonitor, slo: SloTracker) -> ServerMetrics:
        seen = self.engine.metrics()
        metrics = ServerMetrics(
            seen.stats, seen.scheduler, seen.vtc_counters, loop_lag=loop_lag, adapters=seen.adapters, slo=slo
        )
        if self.engines.several:
            metrics.registry.register(BaseGauges([(e.base_name, e.digest, e.stats) for e in self.engines.engines]))
        return metrics

    def models(self, access: Access, started: int, draining: Collection[str]) -> ModelsView:
        engine = self.engine
        card = BaseCard(engine.base_name, engine.max_model_len, started, serves_base=engine.merged_adapter is None)
        more = [BaseCard(e.base_name, e.max_model_len, started) for e in self.engines.engines[1:]]

        def serving() -> list[str]:
            merged = engine.merged_adapter
            if merged is not None:  # a dedicated deployment serves its one version
                return [merged.partition("@")[0]]
            if self.engines.several:
                self._bases_of.clear()
                self._bases_of.update(
                    {i: base for i, (key, base) in self.engines.served_ids().items() if key not in draining}
                )
                return list(self._bases_of)
            versions = engine.admin.catalog.versions()
            return [v.adapter_id for v in versions if v.current and v.servable and v.key not in draining]

        return ModelsView(
            access,
            card,
            serving=serving,
            key=lambda: (engine.admin.catalog.generation, frozenset(draining)),
            more_bases=more,
            base_of=self._bases_of.get,
        )

    def version(self, name: str) -> str:
        try:
            return self.engines.serving_key(name)
        except AdapterEnvelopeError:  # the shared engine refuses its shape: a merged engine may serve it
            key = self.engine.admin.catalog.row(name).key
            promotion = self.dedicated.promotions.get(parse_name(key)[0])
            if self.dedicated.auto or (promotion is not None and promotion.key == key and promotion.state != "failed"):
                return key
            raise

    def base_named(self, model: str) -> str | None:
        return next((n for n in self._side_names if model == n or model.startswith(n + ":")), None)

    def base_of(self, key: str) -> str | None:
        if not self.engines.several:
            return None
        base = self.engines.base_of_key(key)
        return base.name if base is not None else None

    def max_adapter_tokens(self, adapter: str | None) -> int | None:
        # A dedicated deployment runs its adapter on the base path, which the bound does not cover.
        merged = self.engine.merged_adapter is not None or (adapter is not None and not self._shared(adapter))
        return None if merged else self.engine.config.max_adapter_tokens

    def _shared(self, key: str) -> bool:
        """Whether the shared engines serve version ``key`` (not promoted, not outside the envelope)."""
        promotion = self.dedicated.promotions.get(parse_name(key)[0])
        if promotion is not None and promotion.key == key and promotion.state in ("starting", "merged"):
            return False
        return self.engines.several or self.engine.admin.has_version(key)

    async def outputs(self, job: Job, headers: dict[str, str]) -> TokenStream:
        progress: list[PromptProgress] = []
        merged = await self.dedicated.serving(job.adapter) if job.adapter is not None else None
        engine = merged.engine if merged is not None and merged.engine is not None else None
        outputs = engine_outputs(engine or self.engines.engine_for(job.adapter, job.model), job, progress)
        if merged is not None:
            merged.in_flight += 1
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()
            job.prompt_computed = sum(p.computed for p in progress)  # the generators have ended: filled in
            if merged is not None:
                merged.in_flight -= 1
            if engine is not None:  # its traffic is the adapter's: into the primary's table and tiers
                self.engine.admin.tiers.usage.restore_traffic(engine.admin.tiers.usage.take_traffic())

    def record_rejected(self, tenant: str, tokens: int, reason: str) -> None:
        self.engine.metrics().scheduler.record_rejected(tenant, tokens, reason)

    def overload_retry_after(self, admissions_per_s: float) -> int | None:
        return overload_retry_after_s(self.engine.stats().queue_depth, self.queue_len, admissions_per_s)

    def finished(self, job: Job) -> None:
        self.dedicated.observe(job.adapter, job.generated)  # the engines count their own traffic; hot enough?

    def offer_prompt(self, adapter: str, prompt: list[int]) -> None:
        self.sampler.offer(parse_name(adapter)[0], prompt)  # opted-in ids only: a set lookup

    async def usage_rows(self, since_hour: int | None) -> list[tuple[Key, Usage]]:
        merged = [e.usage_rows(since_hour=since_hour) for e in self.dedicated.engines()]
        if not merged:
            return self.engines.usage_rows(since_hour=since_hour)  # every base's engine (--base)
        return summed([self.engines.usage_rows(since_hour=since_hour), *merged])  # and the merged engines'

    def after_request(self) -> None:
        try:
            self.engines.sync()  # an admin change reaches the other bases' engines now
        except Exception:  # never turn an answered (maybe committed) request into a 500: retried next request
            log.exception("mirroring the registry into the other bases' engines failed")

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        self.engines.set_tenant_weights(weights)

    def abort(self, request_id: str) -> None:
        self.engines.abort(request_id)
        for engine in self.dedicated.engines():
            engine.abort(request_id)

    async def start(self) -> None:
        """Adapters pinned before a restart load now, not at the first request (on every base's
        engine); the prompt sampler starts."""
        for engine in self.engines.engines:
            await engine.admin.restore_pins()
        self.sampler_task = asyncio.get_running_loop().create_task(self.sampler.run(self.engine))
        self.dedicated.start()

    async def stop(self) -> None:
        await self.dedicated.close()
        if self.sampler_task is not None:
            self.sampler_task.cancel()
            try:
                await self.sampler_task
            except asyncio.CancelledError:
                pass
        try:  # what was sampled since the last flush
            await self.sampler.flush(self.engine)
        except Exception:
            log.exception("storing sampled check prompts failed")


ENGINES = web.AppKey("lorapage_engines", EngineBackend)  # lorapage serve's backend, for its own routes

"""``Engine.debug``: a read-only view of the engine's parts, for tests and diagnostics.

The engine's own surface is what callers need (generate, abort, stats, metrics, admin, close);
whatever looks inside it (a test that checks a page came back, a benchmark that times the
forward pass) goes through this view, so the engine's public attributes stay few and a reader
sees at a glance which code reaches past them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorapage.adapters.cache import AdapterCache
    from lorapage.adapters.metrics import AdapterMetrics
    from lorapage.adapters.residency import Residency
    from lorapage.engine.build import (
        AdapterParts,
        ForwardParts,
        MemoryParts,
        SchedulingParts,
        Sizing,
    )
    from lorapage.engine.build_catalog import CatalogParts
    from lorapage.engine.devices import Threads
    from lorapage.engine.intake import RequestIntake
    from lorapage.engine.step_loop import StepLoop
    from lorapage.engine.step_planner import StepPlanner
    from lorapage.engine.tiering import TierKeeper
    from lorapage.kernels.backend import KernelOps
    from lorapage.memory.pool import PagePool
    from lorapage.memory.prefix_cache import PrefixCache
    from lorapage.memory.reclaim import Reclaim
    from lorapage.model.lora_tables import LoraTables
    from lorapage.model.runner import ModelRunner
    from lorapage.parallel import TensorParallelGroup
    from lorapage.registry.catalog import AdapterCatalog
    from lorapage.request import Request
    from lorapage.scheduler import SchedulerMetrics, SchedulerPolicy
    from lorapage.sources import AdapterRoots, AdapterSources
    from lorapage.structured.grammars import GrammarCompiler
    from lorapage.usage import UsageLedger


@dataclass(frozen=True)
class EngineDebug:
    """The engine's parts by name (see :mod:`lorapage.engine.build` for what each is)."""

    clock: Callable[[], float]
    sizing: Sizing
    threads: Threads
    # memory
    pool: PagePool
    tables: LoraTables
    prefix_cache: PrefixCache
    reclaim: Reclaim
    # the forward pass
    runner: ModelRunner
    ops: KernelOps
    parallel: TensorParallelGroup | None  # the other tensor-parallel ranks (None: one device)
    # adapters
    residency: Residency
    adapters: AdapterCache
    sources: AdapterSources
    adapter_roots: AdapterRoots
    catalog: AdapterCatalog
    tiers: TierKeeper
    usage: UsageLedger
    adapter_metrics: AdapterMetrics
    # scheduling
    policy: SchedulerPolicy[Request]
    step_planner: StepPlanner
    step_loop: StepLoop
    intake: RequestIntake
    grammars: GrammarCompiler
    scheduler_metrics: SchedulerMetrics

    @classmethod
    def of(
        cls,
        clock: Callable[[], float],
        sizing: Sizing,
        memory: MemoryParts,
        forward: ForwardParts,
        threads: Threads,
        adapters: AdapterParts,
        scheduling: SchedulingParts,
        catalog: CatalogParts,
    ) -> EngineDebug:
        return cls(
            clock=clock,
            sizing=sizing,
            threads=threads,
            pool=memory.pool,
            tables=memory.tables,
            prefix_cache=memory.prefix_cache,
            reclaim=memory.reclaim,
            runner=forward.runner,
            ops=forward.ops,
            parallel=forward.parallel,
            residency=adapters.residency,
            adapters=adapters.cache,
            sources=adapters.sources,
            adapter_roots=adapters.roots,
            catalog=catalog.catalog,
            tiers=catalog.tiers,
            usage=adapters.usage,
            adapter_metrics=adapters.metrics,
            policy=scheduling.policy,
            step_planner=scheduling.planner,
            step_loop=scheduling.step_loop,
            intake=scheduling.intake,
            grammars=scheduling.grammars,
            scheduler_metrics=scheduling.metrics,
        )

    @property
    def io_threads(self) -> int:
        return self.threads.io_threads

    @property
    def forward_threads(self) -> int:
        return self.threads.forward_threads

    @property
    def max_resident_loras(self) -> int:
        return self.residency.limits.max_resident_loras

    def pool_free_pages(self) -> int:
        """Pages free for new work: free ones, and cached KV blocks nobody holds (given back by
        value per page, with idle adapters); ``stats().pool_pages_free``."""
        return self.pool.num_free + self.prefix_cache.num_idle

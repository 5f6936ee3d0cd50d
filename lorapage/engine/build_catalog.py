"""The builders of an engine's control over its adapters, after :mod:`lorapage.engine.build`'s
adapter parts: the catalog (with the registry it alone holds) and the traffic tiers, then, once
the step loop exists, ``engine.admin`` with its pusher of versions from memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorapage.adapters.tiers import TierRules
from lorapage.config import EngineConfig
from lorapage.engine.admin import AdapterAdmin
from lorapage.engine.build import AdapterParts, BaseParts, SchedulingParts
from lorapage.engine.devices import Threads
from lorapage.engine.tiering import TierKeeper
from lorapage.registry.catalog import AdapterCatalog
from lorapage.registry.prepare import VersionPreparer
from lorapage.registry.push import VersionPusher, push_root
from lorapage.registry.store import REGISTRY_FILE, Registry
from lorapage.registry.traffic import RegistryTraffic


@dataclass(frozen=True)
class CatalogParts:
    """The registered versions (restored from the registry, the catalog's alone) and their traffic tiers."""

    catalog: AdapterCatalog
    tiers: TierKeeper


def build_catalog(
    config: EngineConfig,
    base: BaseParts,
    threads: Threads,
    adapters: AdapterParts,
    check_open: Callable[[], None],
) -> CatalogParts:
    """``check_open``: raises once the engine is closed (admin calls refuse then)."""
    preparer = VersionPreparer(
        adapters.cache,
        base.binding,
        adapters.sources,
        roots=adapters.roots,
        download_cache=adapters.sources_cache_dir,
        base_digest=base.digest,
        io_executor=threads.io,
        check_open=check_open,
    )
    # Restores every version committed before a restart (reading no weights); the registry is its alone.
    registry = Registry(_registry_path(config))
    catalog = AdapterCatalog(
        adapters.cache,
        registry,
        preparer,
        base_digest=base.digest,
        io_executor=threads.io,
        locate=adapters.files.locate,
        check_open=check_open,
    )
    adapters.metrics.projected_costs = catalog.current_costs  # the metrics were made before the catalog
    # The traffic table and tiers: counts batched from the ledger, written and judged off the loop.
    tiers = TierKeeper(
        TierRules.from_config(config),
        adapters.usage,
        RegistryTraffic(registry),
        adapters.cache,
        threads.io,
        adapters.wall_clock,
        interval_s=config.tier_interval_s,
        retention_hours=config.traffic_retention_hours,
        audit_retention_s=config.audit_retention_days * 86400,
    )
    return CatalogParts(catalog, tiers)


def build_admin(
    config: EngineConfig,
    threads: Threads,
    adapters: AdapterParts,
    catalog: CatalogParts,
    scheduling: SchedulingParts,
    check_open: Callable[[], None],
) -> AdapterAdmin:
    """``engine.admin``, over the catalog (made last: its loads bind the step loop); versions
    pushed from memory keep their files beside the registry."""
    pusher = VersionPusher(catalog.catalog, adapters.cache, push_root(_registry_path(config)), threads.io)
    bind = scheduling.step_loop.bind
    return AdapterAdmin(catalog.catalog, adapters.cache, catalog.tiers, pusher, check_open=check_open, bind=bind)


def _registry_path(config: EngineConfig) -> str:
    return str(Path(config.state_dir) / REGISTRY_FILE) if config.state_dir is not None else ":memory:"

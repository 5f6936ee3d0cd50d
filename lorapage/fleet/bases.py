"""Several bases in one fleet: one engine deployment per base, and which one a request goes to.

``lorapage fleet --model A --base B`` deploys the engine deployment of base A (the *primary*,
``EngineReplica``) and one of base B (``EngineReplica-<B's directory name>``), each with
``--replicas`` replicas, its own affinity router and the same engine flags. Every replica mirrors
the fleet's one registry (the ingress's) and serves the versions bound to its base. The ingress
routes by :func:`lorapage.serve.engines.route_base`, the rule ``lorapage serve --base`` uses: a
request's adapter version goes to the deployment of the base it is bound to (409 naming its digest
when none runs it), a request naming a base model to that base's, the rest to the primary's; an
alias at a version migrated onto a served base serves its migration (:func:`~lorapage.serve.engines.followed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lorapage.bases.serving import ServedBase, route_base, served_migrations, version_across
from lorapage.config import EngineConfig
from lorapage.fleet.registry import FleetRegistry


def base_engine(engine: EngineConfig, model: str) -> EngineConfig:
    """The replicas' engine config for base ``model``: the primary's flags, that model."""
    return dataclasses.replace(engine, model=model)


class FleetBases:
    """The ingress's engine deployments, one per base (the primary's first), and the routing rule over them."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)  # DeploymentHandles, in the order of the bases
        self.bases: list[ServedBase] = []  # known once every deployment has told its profile
        self._migrations: dict[str, str] = {}
        self._migrations_at = -1  # the registry generation they were read at

    @property
    def several(self) -> bool:
        return len(self.handles) > 1

    async def served(self) -> list[ServedBase]:
        """Each deployment's base, asked of one of its replicas once (none asked with one base)."""
        if self.several and len(self.bases) < len(self.handles):
            profiles = [await handle.profile.remote() for handle in self.handles]
            self.bases = [ServedBase(p.base_name, p.base_digest) for p in profiles]
        return self.bases

    def named(self, model: str) -> str | None:
        """The base ``model`` names (a base's name, or ``NAME:adapter``), if any."""
        return next((b.name for b in self.bases if model == b.name or model.startswith(b.name + ":")), None)

    def serving_key(self, registry: FleetRegistry, name: str) -> str:
        """The version key ``name`` serves now: on the registry's one base as before, or on
        whichever base a deployment runs; 404 when there is none, 409 naming its base's digest
        when no deployment runs that base."""
        if not self.several:
            return registry.resolve_version(name)
        return version_across(name, registry.index.row, self._served_migrations(registry), self.bases)[0]

    def handle_for(self, registry: FleetRegistry, adapter: str | None, model: str) -> Any:
        """The deployment handle of the base a resolved request runs on."""
        if not self.several:
            return self.handles[0]
        row = registry.index.row(adapter) if adapter is not None else None
        base = route_base(self.bases, version_base=row.base_digest if row else None, model=model)
        return self.handles[self.bases.index(base)] if base is not None else self.handles[0]

    def handle_of(self, base_digest: str) -> Any:
        """The deployment handle of the base ``base_digest`` (a replica's heartbeat says it; unknown: the primary's)."""
        digests = [b.digest for b in self.bases]
        return self.handles[digests.index(base_digest)] if base_digest in digests else self.handles[0]

    def base_of(self, registry: FleetRegistry, key: str) -> ServedBase | None:
        """The base version ``key`` runs on (None: not served)."""
        row = registry.index.row(key)
        return route_base(self.bases, version_base=row.base_digest) if row is not None else None

    def _served_migrations(self, registry: FleetRegistry) -> dict[str, str]:
        """Version key -> its migration onto a base served here, read again after a registry change."""
        if self._migrations_at != registry.generation:
            served = {b.digest for b in self.bases}
            self._migrations = served_migrations(registry.registry.migration_states(), served)
            self._migrations_at = registry.generation
        return self._migrations

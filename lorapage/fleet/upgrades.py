"""A base upgrade in a fleet: ``lorapage serve``'s validate and migrate routes (:mod:`lorapage.frontend.bases_route`)
over the fleet's deployments and registry, while both bases serve.

The fleet checks toward a base it runs beside its primary (``lorapage fleet --base``,
:mod:`lorapage.fleet.bases`): each adapter version's drift check runs its first half (greedy, with
logprobs) on a replica of the primary's deployment, routed to the adapter's owner, and its second
half (teacher-forced and free) on a replica of the new base's deployment, where the version's files
are registered under an id of the job's own for the check and removed after it
(:meth:`~lorapage.fleet.replica.EngineReplica.drift_references`, ``drift_candidate``). States,
numbers and notices go to the fleet's registry, as one server's go to its own; a migration stores
the new version in the fleet's registry, which every replica mirrors, and the ingress routes the id
to it (an alias at a version migrated onto a served base serves its migration). A base the fleet
does not run is refused (400): its candidate cannot be loaded in the ingress.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ray.exceptions import RayActorError

from lorapage.adapters.binding import shown_digest
from lorapage.adapters.names import parse_name
from lorapage.bases.drift import PromptDrift
from lorapage.bases.validation import BaseValidator, ValidationJob, check_name
from lorapage.errors import InvalidRequestError, ServiceUnavailableError
from lorapage.fleet.bases import FleetBases
from lorapage.fleet.messages import answered
from lorapage.fleet.registry import FleetRegistry
from lorapage.registry.drift_state import MigrationRow
from lorapage.registry.store import VersionRow

Writer = Callable[[Callable[[], VersionRow]], Awaitable[VersionRow]]  # FleetRegistry.write
CHECK_TIMEOUT_S = 900.0  # for one half of one version's drift check on a replica (~200 prompts)


class FleetChecker:
    """One version's check on two deployments: the primary's (``old``) and the new base's (``new``).

    A half that a replica does not answer (it died, or Ray is replacing it and the call waits)
    fails that version's check alone, as "could not run" (503), after ``timeout_s``; the job goes on."""

    def __init__(self, old: Any, new: Any, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.old, self.new, self.timeout_s = old, new, timeout_s

    async def drifts(
        self, job: ValidationJob, key: str, prompts: tuple[str, ...], max_tokens: int
    ) -> list[PromptDrift]:
        adapter_id = parse_name(key)[0]
        old = self.old.options(multiplexed_model_id=adapter_id)  # to its owner, where it is warm
        refs = await self._half(old.drift_references.remote(key, list(prompts), max_tokens), "the base's", key)
        new = self.new.options(multiplexed_model_id=adapter_id)
        name = check_name(job, adapter_id)
        return await self._half(new.drift_candidate.remote(key, name, job.target, refs), "the new base's", key)

    async def _half(self, call: Any, which: str, key: str) -> Any:
        try:
            return answered(await asyncio.wait_for(call, self.timeout_s))
        except (TimeoutError, RayActorError):
            call.cancel()
            raise ServiceUnavailableError(
                f"{which} replica did not answer {key}'s check within {self.timeout_s:g}s (it may be restarting)",
                retry_after=5,
            ) from None

    async def close(self) -> None:
        pass  # nothing of the job's outlives a check


class FleetUpgrades:
    """The :class:`~lorapage.frontend.bases_route.BaseUpgrades` of a fleet running ``bases`` (the primary's first)."""

    def __init__(
        self, bases: FleetBases, registry: FleetRegistry, digest: str, models: Sequence[str], write: Writer
    ) -> None:
        """``models``: each base's directory, in the order of ``bases`` (what a job shows as its
        candidate); ``write``: runs a registry change in turn with the admin routes' (FleetRegistry.write)."""
        self.bases, self.fleet_registry, self.models, self.write = bases, registry, list(models), write
        self.drift_record = registry.drift_record
        self.digest = digest

    def current_versions(self, adapters: Sequence[str] | None) -> list[str]:
        """Each id's current version where it is on the primary base (an id named that is not: 400)."""
        keys = []
        for adapter_id in list(adapters) if adapters is not None else self.fleet_registry.index.ids():
            row = self.fleet_registry.index.row(adapter_id) if "@" not in adapter_id else None
            servable = row is not None and row.base_digest == self.digest
            if row is None or (not servable and adapters is not None):
                raise InvalidRequestError(
                    f"adapter {adapter_id!r} has no current version served on this base", param="adapters"
                )
            if servable:
                keys.append(row.key)
        return keys

    async def validate(
        self, validator: BaseValidator, target: str, model: str | None, adapters: Sequence[str] | None
    ) -> ValidationJob:
        digests = [b.digest for b in self.bases.bases]
        if target not in digests[1:]:
            raise InvalidRequestError(
                f"this fleet does not run base {shown_digest(target)}: start it beside the primary with "
                "lorapage fleet --base DIR, then validate toward it",
                param="digest",
            )
        new = self.bases.handles[digests.index(target)]
        checker = FleetChecker(self.bases.handles[0], new)

        async def make(job: ValidationJob) -> FleetChecker:
            return checker

        keys = self.current_versions(adapters)
        candidate = self.models[
            digests.index(target)
        ]  # the directory its deployment runs (a model given is not loaded)
        return validator.start_with(self.drift_record, self.digest, target, candidate, keys, make)

    async def migrate(self, row: MigrationRow, actor: str) -> VersionRow:
        return await self.write(lambda: self.fleet_registry.migrate(row, actor=actor))

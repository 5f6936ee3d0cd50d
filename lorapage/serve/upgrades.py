"""``lorapage serve``'s side of the base-upgrade routes (:mod:`lorapage.frontend.bases_route`):
the primary engine's registry, and a candidate base either served beside it or loaded."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from lorapage.adapters.binding import shown_digest
from lorapage.bases.validation import BaseValidator, ValidationJob, check_model_dir, current_versions
from lorapage.errors import InvalidRequestError
from lorapage.registry.drift_state import MigrationRow
from lorapage.registry.store import VersionRow
from lorapage.serve.engines import Engines


class LocalUpgrades:
    """``lorapage serve``'s: the primary engine's registry; the candidate a base served beside it
    (``--base``), else one loaded from the directory the request names."""

    def __init__(self, engines: Engines) -> None:
        self.engines, self.engine = engines, engines.engines[0]
        self.digest, self.drift_record = self.engine.digest, self.engine.admin.catalog.drift_record

    def current_versions(self, adapters: Sequence[str] | None) -> list[str]:
        return current_versions(self.engine, adapters)

    async def validate(
        self, validator: BaseValidator, target: str, model: str | None, adapters: Sequence[str] | None
    ) -> ValidationJob:
        running = self.engines.side_engine(target)  # a base served beside the primary: checked there, not loaded
        named = running.config.model if running is not None else model
        if named is None:
            raise InvalidRequestError(
                f"model: the directory of base {shown_digest(target)} is required (this server does not run it)",
                param="model",
            )
        checked = await asyncio.to_thread(check_model_dir, named)
        return validator.start(self.engine, target, checked, adapters, running=running)

    async def migrate(self, row: MigrationRow, actor: str) -> VersionRow:
        return await self.engine.admin.catalog.migrate_version(row, actor=actor)

"""``lorapage base check --state-dir``: a server's registry as the check's source and its record.

Opened only while no server holds the state dir (its lock, :class:`StateDirLock`). Each adapter
the command checks is an id there whose current version is bound to the old base; the check adds
its stored check prompts (:meth:`CheckPrompts.all_prompts`) to the prompts file's, and records
its migration state toward the new base as a validation job does
(:mod:`lorapage.bases.validation`): passed or failed with the numbers and the notice, or
opted-out when its owner opted out (checked all the same, never moved).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from lorapage.adapters.binding import shown_digest
from lorapage.adapters.state_lock import StateDirError, StateDirLock
from lorapage.bases.drift import DriftReport
from lorapage.flags import fail
from lorapage.registry.drift_state import FAILED, OPTED_OUT, PASSED, MigrationRow
from lorapage.registry.store import REGISTRY_FILE, Registry

PROG = "lorapage base check"
JOB = "cli"  # the job column of the states the command records


@dataclass
class StoredStates:
    """The registry of a state dir, held for the command's run."""

    registry: Registry
    lock: StateDirLock
    old: str  # stored digests
    new: str
    versions: dict[str, int]  # adapter id -> its current version (bound to ``old``)
    prompts: dict[str, list[str]]  # adapter id -> its stored check prompts
    opted_out: set[str]

    @classmethod
    def open(cls, state_dir: str, old_dir: str, new_dir: str, names: list[str]) -> StoredStates:
        """Lock and open ``state_dir``'s registry and read what the check needs (an error ends the command)."""
        from lorapage.model.loader import model_digest

        try:
            lock = StateDirLock(Path(state_dir))
        except StateDirError as exc:
            fail(PROG, str(exc))
        registry = Registry(Path(state_dir) / REGISTRY_FILE)
        old, new = model_digest(old_dir), model_digest(new_dir)
        current = {a.adapter_id: a.current for a in registry.adapters()}
        bases = {(v.adapter_id, v.version): v.base_digest for v in registry.versions()}
        versions, prompts, opted_out = {}, {}, set()
        for name in names:
            version = current.get(name)
            if version is None or bases.get((name, version)) != old:
                registry.close()
                lock.release()
                fail(
                    PROG, f"--state-dir {state_dir}: {name!r} is not an id whose current version is bound to {old_dir}"
                )
            settings = registry.check_prompts(name)
            versions[name], prompts[name] = version, list(settings.all_prompts())
            if settings.opt_out:
                opted_out.add(name)
        return cls(registry, lock, old, new, versions, prompts, opted_out)

    def record(self, reports: Mapping[str, DriftReport]) -> None:
        """Each adapter's migration state toward the new base, in one transaction."""
        rows = []
        for name, report in reports.items():
            state = OPTED_OUT if name in self.opted_out else PASSED if report.passed else FAILED
            base = MigrationRow(name, self.versions[name], self.new, state, None, None, None, JOB, None, 0.0)
            rows.append(
                dataclasses.replace(
                    base,
                    reason="the owner opted out of base migrations"
                    if state == OPTED_OUT
                    else "; ".join(report.reasons) or None,
                    numbers=asdict(report),
                    notice=report.notice(name, shown_digest(self.old), shown_digest(self.new)),
                )
            )
        self.registry.set_migration_states(rows)

    def close(self) -> None:
        self.registry.close()
        self.lock.release()

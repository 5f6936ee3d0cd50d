"""The durable adapter registry: adapter ids, their immutable versions and aliases, in SQLite.

One file under ``--state-dir`` (``:memory:`` for an embedded engine given no path), in WAL mode
with ``synchronous=FULL``: a registration is one transaction, so a ``kill -9`` at any moment
leaves each version either committed whole or absent, and the server answers 201 only after the
commit. The registry only persists; the engine keeps the live view in memory and writes here
first (see :mod:`lorapage.registry.catalog`).

The tables and their schema steps are :mod:`lorapage.registry.schema`'s.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lorapage.adapters.names import parse_name, version_key
from lorapage.errors import AdapterNotFoundError, ConflictError
from lorapage.registry import audit, drift_state
from lorapage.registry.audit import DEFAULT_CHANNEL, OK, AliasMove, AuditEntry, AuditQuery
from lorapage.registry.drift_state import MIGRATED, CheckPrompts, MigrationRow
from lorapage.registry.schema import MIGRATIONS, SCHEMA, SCHEMA_VERSION, TRAFFIC_SCHEMA
from lorapage.usage.ledger import RETENTION_HOURS  # the usage ledger's 14 days

REGISTRY_FILE = "registry.sqlite3"
# A version number as a name spells it: ASCII digits only (``str.isdigit`` takes "²", which
# ``int`` refuses), and few enough that parsing it costs nothing (``int`` of 4,300 digits raises).


@dataclass(frozen=True)
class VersionRow:
    """One immutable version of an adapter, as stored."""

    adapter_id: str
    version: int
    digest: str
    source: str
    base_digest: str
    spec: str
    created: float
    pinned: bool = False  # an admin pinned it resident: loaded at start, never evicted
    projected_cost_pct: float | None = None  # extra decode bytes at the reference batch, % of the base's

    @property
    def key(self) -> str:
        return version_key(self.adapter_id, self.version)


@dataclass(frozen=True)
class AdapterRow:
    adapter_id: str
    owner: str | None
    current: int | None


@dataclass(frozen=True)
class TrafficRow:
    """One version's traffic in one calendar hour (or what to add to it)."""

    adapter_id: str
    version: int
    hour: int  # hours since the Unix epoch (UTC): the hour starting at hour x 3600
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def key(self) -> str:
        return version_key(self.adapter_id, self.version)


class RegistrySchemaError(RuntimeError):
    """The registry file has a schema this lorapage cannot read."""


def removable_keys(
    name: str, versions: Collection[int], current: int | None, channels: Mapping[str, int] | None = None
) -> list[str]:
    """The version keys deleting ``name`` removes, given the versions its id has, the one its
    alias points at and its named ``channels``: one for ``id@N``, every one for ``id``. Deleting
    the current version of an id that has others is refused (409): re-point the alias first; so
    is one a channel points at: point the channel elsewhere or delete it first."""
    adapter_id, version = parse_name(name)
    if not versions or (version is not None and version not in versions):
        raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="id")
    if version is None:
        return [version_key(adapter_id, v) for v in versions]
    if version == current and len(versions) > 1:
        others = ", ".join(str(v) for v in versions if v != version)
        raise ConflictError(
            f"{name} is the version {adapter_id!r} serves; point the alias at another version "
            f"({others}) first, or DELETE {adapter_id} to remove every version",
            param="id",
        )
    held = [c for c, v in (channels or {}).items() if v == version]
    if held and len(versions) > 1:
        raise ConflictError(
            f"{name} is the version channel {held[0]!r} serves ({adapter_id}@{held[0]}); point the channel at "
            f"another version, or delete it (DELETE /v1/adapters/{adapter_id}/channels/{held[0]}), first",
            param="id",
        )
    return [version_key(adapter_id, version)]


class Registry:
    """SQLite persistence of adapter ids, versions and aliases. Thread-safe (one lock): the
    engine calls it from a worker thread so a commit's fsync never holds the event loop."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT) below.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before it returns
        self._db.execute("PRAGMA foreign_keys=ON")
        with self._lock, self._transaction():
            for statement in filter(str.strip, SCHEMA.split(";")):
                self._db.execute(statement)
            row = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row is None:
                for statement in (*audit.SCHEMA, *audit.RETENTION_SCHEMA, *TRAFFIC_SCHEMA, *drift_state.SCHEMA):
                    self._db.execute(statement)
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            else:
                self._migrate(int(row[0]))

    def _migrate(self, found: int) -> None:
        """Bring a file of schema ``found`` to :data:`SCHEMA_VERSION` (inside the opening
        transaction: a crash leaves it as it was)."""
        if not 1 <= found <= SCHEMA_VERSION:
            raise RegistrySchemaError(
                f"adapter registry {self.path} has schema {found}; this lorapage reads schemas 1 to "
                f"{SCHEMA_VERSION}: use the lorapage that wrote it, or a newer one"
            )
        for version in range(found, SCHEMA_VERSION):
            for statement in MIGRATIONS[version]:
                self._db.execute(statement)
        self._db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (str(SCHEMA_VERSION),))

    def _transaction(self):
        return _Transaction(self._db)

    # -- reads ----------------------------------------------------------------------------------

    def adapters(self) -> list[AdapterRow]:
        with self._lock:
            rows = self._db.execute("SELECT id, owner, current FROM adapters ORDER BY created, id").fetchall()
        return [AdapterRow(*r) for r in rows]

    def versions(self) -> list[VersionRow]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, version, digest, source, base_digest, spec, created, pinned, projected_cost_pct "
                "FROM versions ORDER BY id, version"
            ).fetchall()
        return [VersionRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], bool(r[7]), r[8]) for r in rows]

    def channels(self) -> list[tuple[str, str, int]]:
        """Every named channel: ``(id, name, version)``."""
        with self._lock:
            return self._db.execute("SELECT id, name, version FROM channels ORDER BY id, name").fetchall()

    def audit(self, query: AuditQuery) -> list[AuditEntry]:
        """The audit rows ``query`` selects, newest first."""
        with self._lock:
            return audit.entries(self._db, query)

    def alias_history(self, adapter_id: str, limit: int | None = None) -> list[AliasMove]:
        """``adapter_id``'s alias moves, every channel, newest first."""
        with self._lock:
            return audit.moves(self._db, adapter_id, limit)

    # -- writes: each one transaction -----------------------------------------------------------

    def add_version(
        self,
        adapter_id: str,
        owner: str | None,
        *,
        digest: str,
        source: str,
        base_digest: str,
        spec: str,
        activate: bool,
        projected_cost_pct: float | None = None,
        actor: str | None = None,
    ) -> VersionRow:
        """Store a new version of ``adapter_id`` (creating the id, owned by ``owner``, on first
        use) and point the alias at it when ``activate`` (or when the id has no current one),
        audited as ``actor``'s. ConflictError, and nothing stored, when the id has versions of
        another owner."""
        now = time.time()
        with self._lock, self._transaction():
            row = self._db.execute(
                "SELECT next_version, current, owner, EXISTS (SELECT 1 FROM versions WHERE id = adapters.id) "
                "FROM adapters WHERE id = ?",
                (adapter_id,),
            ).fetchone()
            if row is None:
                version, current = 1, None
                self._db.execute(
                    "INSERT INTO adapters (id, owner, current, next_version, created) VALUES (?, ?, NULL, 2, ?)",
                    (adapter_id, owner, now),
                )
            else:
                version, current, stored_owner, has_versions = row
                # Checked here, in the transaction, not only in a live view: another process (or
                # one that started before this id was taken) must not add content under its owner.
                if has_versions and stored_owner != owner:
                    raise ConflictError(
                        f"adapter id {adapter_id!r} belongs to another tenant; choose another id", param="id"
                    )
                self._db.execute(
                    "UPDATE adapters SET next_version = ?, owner = ? WHERE id = ?", (version + 1, owner, adapter_id)
                )
            self._db.execute(
                "INSERT INTO versions (id, version, digest, source, base_digest, spec, created, projected_cost_pct) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (adapter_id, version, digest, source, base_digest, spec, now, projected_cost_pct),
            )
            after = version if activate or current is None else current
            if after != current:
                self._db.execute("UPDATE adapters SET current = ? WHERE id = ?", (version, adapter_id))
                audit.record_move(self._db, now, adapter_id, DEFAULT_CHANNEL, current, after, "register", actor)
            audit.append(
                self._db,
                now,
                actor,
                "register",
                adapter_id,
                tenant=owner,
                before={"current": current},
                after={"version": version, "current": after, "digest": digest},
            )
        return VersionRow(
            adapter_id, version, digest, source, base_digest, spec, now, projected_cost_pct=projected_cost_pct
        )

    def set_current(
        self, adapter_id: str, version: int, *, action: str = "deploy", actor: str | None = None
    ) -> int | None:
        """Re-point the alias (``action``: deploy, rollback, or register for known content): one
        UPDATE, atomic, with its history and audit rows. Returns where it pointed before."""
        now = time.time()
        with self._lock, self._transaction():
            before, owner = self._alias(adapter_id)
            self._db.execute("UPDATE adapters SET current = ? WHERE id = ?", (version, adapter_id))
            audit.record_move(self._db, now, adapter_id, DEFAULT_CHANNEL, before, version, action, actor)
            audit.append(
                self._db,
                now,
                actor,
                action,
                adapter_id,
                tenant=owner,
                before={"current": before},
                after={"current": version},
            )
        return before

    def set_channel(
        self, adapter_id: str, channel: str, version: int | None, *, action: str, actor: str | None
    ) -> int | None:
        """Point ``adapter_id``'s channel ``channel`` at ``version`` (None: remove the channel),
        with its history and audit rows. Returns where it pointed before."""
        now = time.time()
        with self._lock, self._transaction():
            _, owner = self._alias(adapter_id)
            row = self._db.execute(
                "SELECT version FROM channels WHERE id = ? AND name = ?", (adapter_id, channel)
            ).fetchone()
            before = row[0] if row is not None else None
            if version is None:
                self._db.execute("DELETE FROM channels WHERE id = ? AND name = ?", (adapter_id, channel))
            else:
                self._db.execute(
                    "INSERT INTO channels (id, name, version) VALUES (?, ?, ?) "
                    "ON CONFLICT (id, name) DO UPDATE SET version = excluded.version",
                    (adapter_id, channel, version),
                )
            audit.record_move(self._db, now, adapter_id, channel, before, version, action, actor)
            audit.append(
                self._db,
                now,
                actor,
                action,
                adapter_id,
                tenant=owner,
                before={"channel": channel, "version": before},
                after={"channel": channel, "version": version},
            )
        return before

    def set_source(self, adapter_id: str, version: int, source: str, *, actor: str | None = None) -> None:
        """Version ``adapter_id@version``'s content was registered again from ``source`` (same
        digest, just read there): later loads read it from there. Audited as a ``register``."""
        with self._lock, self._transaction():
            row = self._db.execute(
                "SELECT source FROM versions WHERE id = ? AND version = ?", (adapter_id, version)
            ).fetchone()
            self._db.execute(
                "UPDATE versions SET source = ? WHERE id = ? AND version = ?", (source, adapter_id, version)
            )
            audit.append(
                self._db,
                time.time(),
                actor,
                "register",
                adapter_id,
                tenant=self._alias(adapter_id)[1],
                before={"version": version, "source": row[0] if row else None},
                after={"version": version, "source": source},
            )

    def set_pinned(
        self, adapter_id: str, version: int, pinned: bool, *, actor: str | None = None, outcome: str = OK
    ) -> None:
        """Record whether version ``adapter_id@version`` is pinned resident: one UPDATE, audited."""
        with self._lock, self._transaction():
            self._db.execute(
                "UPDATE versions SET pinned = ? WHERE id = ? AND version = ?", (int(pinned), adapter_id, version)
            )
            audit.append(
                self._db,
                time.time(),
                actor,
                "pin" if pinned else "unpin",
                adapter_id,
                tenant=self._alias(adapter_id)[1],
                after={"version": version, "pinned": pinned},
                outcome=outcome,
            )

    def record(
        self,
        action: str,
        adapter_id: str | None,
        *,
        actor: str | None,
        tenant: str | None = None,
        before: dict | None = None,
        after: dict | None = None,
        outcome: str = OK,
    ) -> None:
        """Append an audit row for an action that changes nothing stored here (load, unload,
        tenants reload), in a transaction of its own."""
        with self._lock, self._transaction():
            audit.append(
                self._db,
                time.time(),
                actor,
                action,
                adapter_id,
                tenant=tenant,
                before=before,
                after=after,
                outcome=outcome,
            )

    def _alias(self, adapter_id: str) -> tuple[int | None, str | None]:
        """``adapter_id``'s current version and owner (inside a transaction)."""
        row = self._db.execute("SELECT current, owner FROM adapters WHERE id = ?", (adapter_id,)).fetchone()
        return (row[0], row[1]) if row is not None else (None, None)

    def set_projected_costs(self, costs: dict[tuple[str, int], float]) -> None:
        """Record versions' projected costs ((id, version) -> %), all in one transaction: those
        a migration left NULL, or computed for another reference batch or dtype."""
        with self._lock, self._transaction():
            self._db.executemany(
                "UPDATE versions SET projected_cost_pct = ? WHERE id = ? AND version = ?",
                [(pct, adapter_id, version) for (adapter_id, version), pct in costs.items()],
            )

    def delete_version(
        self, adapter_id: str, version: int, new_current: int | None, *, actor: str | None = None
    ) -> None:
        """Remove one version, and the channels pointing at it; the alias moves to
        ``new_current`` (None: no version left)."""
        now = time.time()
        with self._lock, self._transaction():
            before, owner = self._alias(adapter_id)
            channels = self._db.execute(
                "SELECT name FROM channels WHERE id = ? AND version = ?", (adapter_id, version)
            ).fetchall()
            self._db.execute("DELETE FROM versions WHERE id = ? AND version = ?", (adapter_id, version))
            self._db.execute("DELETE FROM channels WHERE id = ? AND version = ?", (adapter_id, version))
            self._db.execute("UPDATE adapters SET current = ? WHERE id = ?", (new_current, adapter_id))
            if new_current is None:  # the id is free for any tenant again; its numbers stay used
                self._db.execute("UPDATE adapters SET owner = NULL WHERE id = ?", (adapter_id,))
            audit.record_move(self._db, now, adapter_id, DEFAULT_CHANNEL, before, new_current, "delete", actor)
            for (name,) in channels:
                audit.record_move(self._db, now, adapter_id, name, version, None, "delete", actor)
            audit.append(
                self._db,
                now,
                actor,
                "delete",
                adapter_id,
                tenant=owner,
                before={"version": version, "current": before},
                after={"current": new_current},
            )

    # -- traffic (schema 4) ----------------------------------------------------------------------

    def add_traffic(self, rows: Iterable[TrafficRow], now_hour: int, retention_hours: int = RETENTION_HOURS) -> None:
        """Add ``rows``' counts to their (version, hour) rows, and delete the hours older than
        ``retention_hours`` before ``now_hour``: one transaction (the engine batches its counts and
        calls this from a worker thread, every few minutes, never per request)."""
        oldest = now_hour - retention_hours
        with self._lock, self._transaction():
            self._db.executemany(
                "INSERT INTO adapter_traffic (id, version, hour, requests, prompt_tokens, output_tokens) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id, version, hour) DO UPDATE SET "
                "requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "output_tokens = output_tokens + excluded.output_tokens",
                [
                    (r.adapter_id, r.version, r.hour, r.requests, r.prompt_tokens, r.output_tokens)
                    for r in rows
                    if r.hour >= oldest
                ],
            )
            self._db.execute("DELETE FROM adapter_traffic WHERE hour < ?", (oldest,))

    def prune_audit(self, before: float) -> int:
        """Delete the audit rows older than ``before`` (Unix seconds): the trail's retention, from
        a worker thread. The rows deleted."""
        with self._lock, self._transaction():
            return audit.prune(self._db, before)

    def traffic(self, since_hour: int, adapter_id: str | None = None) -> list[TrafficRow]:
        """Traffic rows of hour ``since_hour`` and later (of ``adapter_id``'s versions, or of
        every version), by id, version and hour."""
        query = "SELECT id, version, hour, requests, prompt_tokens, output_tokens FROM adapter_traffic WHERE hour >= ?"
        args: tuple[object, ...] = (since_hour,)
        if adapter_id is not None:
            query, args = query + " AND id = ?", (since_hour, adapter_id)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY id, version, hour", args).fetchall()
        return [TrafficRow(*r) for r in rows]

    def weighted_requests(self, weights: Sequence[tuple[int, float, float]]) -> dict[str, tuple[float, float]]:
        """Every version's requests summed over the hours ``weights`` names, twice: each hour's
        requests times its first weight, and times its second. ``(hour, w1, w2)`` per hour; the
        traffic tiers pass the weights of the last hour and the last 24 hours
        (:func:`lorapage.adapters.tiers.window_weights`). Summed in SQLite: one row per version."""
        if not weights:
            return {}
        values = ", ".join("(?, ?, ?)" for _ in weights)
        query = (
            f"WITH w (hour, w1, w2) AS (VALUES {values}) "
            "SELECT t.id || '@' || t.version, SUM(t.requests * w.w1), SUM(t.requests * w.w2) "
            "FROM adapter_traffic AS t JOIN w ON t.hour = w.hour GROUP BY t.id, t.version"
        )
        args = [x for hour, w1, w2 in weights for x in (hour, w1, w2)]
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return {key: (float(a), float(b)) for key, a, b in rows}

    # -- check prompts and migrations (schema 5) --------------------------------------------------

    def check_prompts(self, adapter_id: str) -> CheckPrompts:
        """``adapter_id``'s check prompts and opt-ins (none stored: empty, both off)."""
        with self._lock:
            return drift_state.read_prompts(self._db, adapter_id)

    def set_check_prompts(self, value: CheckPrompts, *, actor: str | None = None) -> None:
        """Replace an id's check prompts and opt-ins, audited (the count, never the text)."""
        now = time.time()
        with self._lock, self._transaction():
            before = drift_state.read_prompts(self._db, value.adapter_id)
            drift_state.write_prompts(self._db, now, value)
            audit.append(
                self._db,
                now,
                actor,
                "check_prompts",
                value.adapter_id,
                tenant=self._alias(value.adapter_id)[1],
                before={"prompts": len(before.prompts), "sample": before.sample, "opt_out": before.opt_out},
                after={"prompts": len(value.prompts), "sample": value.sample, "opt_out": value.opt_out},
            )

    def sampling_ids(self) -> list[str]:
        """The ids whose owners opted in to prompts sampled from their traffic."""
        with self._lock:
            return drift_state.sampling_ids(self._db)

    def add_sampled_prompts(self, adapter_id: str, prompts: Sequence[str]) -> int:
        """Put ``prompts`` (sampled from ``adapter_id``'s traffic) before the ones stored, keeping
        the newest :data:`~lorapage.registry.drift_state.MAX_SAMPLED_PROMPTS`; nothing when its
        owner turned sampling off meanwhile. Returns how many were stored. Not audited: traffic,
        not an admin action."""
        with self._lock, self._transaction():
            old = drift_state.read_prompts(self._db, adapter_id)
            if not old.sample or not prompts:
                return 0
            drift_state.write_prompts(self._db, time.time(), dataclasses.replace(old, sampled=(*prompts, *old.sampled)))
            return min(len(prompts), drift_state.MAX_SAMPLED_PROMPTS)

    def migration_states(self, target: str | None = None, adapter_id: str | None = None) -> list[MigrationRow]:
        """Migration rows toward ``target`` (a stored digest; None: every one), of ``adapter_id``."""
        with self._lock:
            return drift_state.read_states(self._db, target, adapter_id)

    def set_migration_states(self, rows: Iterable[MigrationRow]) -> None:
        """Record (replace) migration rows, in one transaction."""
        now = time.time()
        with self._lock, self._transaction():
            for row in rows:
                drift_state.write_state(self._db, now, row)

    def migrate_version(self, state: MigrationRow, *, actor: str | None = None) -> VersionRow:
        """Store version ``state.adapter_id@state.version`` again as a new version bound to base
        ``state.target`` (same content, source, spec; the alias stays where it is), mark the
        migration ``migrated`` and audit it as ``migrate``: one transaction. The caller checked
        that the state is ``passed``; a migration already done returns its version."""
        now = time.time()
        with self._lock, self._transaction():
            done = self._db.execute(
                "SELECT new_version FROM migrations WHERE id = ? AND version = ? AND target = ? AND state = ?",
                (state.adapter_id, state.version, state.target, MIGRATED),
            ).fetchone()
            if done is not None and done[0] is not None:
                return self._version_row(state.adapter_id, done[0])
            src = self._version_row(state.adapter_id, state.version)
            (number,) = self._db.execute(
                "SELECT next_version FROM adapters WHERE id = ?", (state.adapter_id,)
            ).fetchone()
            self._db.execute("UPDATE adapters SET next_version = ? WHERE id = ?", (number + 1, state.adapter_id))
            self._db.execute(
                "INSERT INTO versions (id, version, digest, source, base_digest, spec, created, pinned) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (src.adapter_id, number, src.digest, src.source, state.target, src.spec, now, int(src.pinned)),
            )
            drift_state.write_state(
                self._db, now, dataclasses.replace(state, state=MIGRATED, reason=None, new_version=number)
            )
            audit.append(
                self._db,
                now,
                actor,
                "migrate",
                state.adapter_id,
                tenant=self._alias(state.adapter_id)[1],
                before={"version": src.version, "base_digest": src.base_digest},
                after={"version": number, "base_digest": state.target, "digest": src.digest},
            )
            return self._version_row(state.adapter_id, number)

    def _version_row(self, adapter_id: str, version: int) -> VersionRow:
        """One stored version (inside the lock)."""
        r = self._db.execute(
            "SELECT id, version, digest, source, base_digest, spec, created, pinned, projected_cost_pct "
            "FROM versions WHERE id = ? AND version = ?",
            (adapter_id, version),
        ).fetchone()
        if r is None:
            raise AdapterNotFoundError(f"adapter {version_key(adapter_id, version)!r} does not exist", param="id")
        return VersionRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], bool(r[7]), r[8])

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``, or ``ROLLBACK`` on an exception (the caller holds the lock)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")

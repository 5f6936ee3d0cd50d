"""The registry's audit trail and alias history: who changed what and when, and where each alias was.

Two append-only tables in the registry's SQLite file (schema 4; triggers refuse any UPDATE or
DELETE of them, but for the audit rows past their retention, schema 6: :func:`prune`):

- ``audit``: one row per admin action that changed something (register, deploy, rollback,
  delete, pin, unpin, channel, load, unload, tenants_reload, check_prompts, migrate: schema 5's
  :mod:`lorapage.registry.drift_state`): a monotonically increasing id
  (``AUTOINCREMENT``: never reused, even after a crash), the time, the actor (a key id, the first
  12 hex of the key's sha256, never the key; ``sighup`` for a signal; NULL for an embedded
  caller), the tenant owning the adapter, the adapter id, what it was before and after (small
  JSON) and the outcome (``ok``, or what else happened, e.g. a pin undone because its load failed).
- ``alias_history``: one row per move of an alias (the id's own, ``channel`` ``""``, or a named
  channel such as ``prod``): the version it pointed at before and after, the action that moved it.
  A one-call rollback walks it back (:func:`rollback_target`).

Both rows are written in the transaction that commits the change they describe (the registry's
write methods call :func:`append` and :func:`record_move` inside it), so a change is never on disk
without its row nor a row without its change. The functions here take the caller's connection and
hold no lock: the registry's lock and transaction cover them.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from lorapage.errors import ConflictError, InvalidRequestError

ACTIONS = (
    "register",
    "deploy",
    "rollback",
    "delete",
    "pin",
    "unpin",
    "channel",
    "load",
    "unload",
    "tenants_reload",
    "check_prompts",
    "migrate",
    "promote",
    "demote",
)
DEFAULT_CHANNEL = ""  # alias_history.channel of the id's own alias
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
OK = "ok"
# A named channel (``id@prod``): a lowercase letter first, so it can never read as a version number.
CHANNEL = re.compile(r"[a-z][a-z0-9_-]{0,31}")

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS audit (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        time REAL NOT NULL,
        actor TEXT,
        tenant TEXT,
        action TEXT NOT NULL,
        adapter TEXT,
        before TEXT,
        after TEXT,
        outcome TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS audit_by_adapter ON audit (adapter, seq)",
    """CREATE TABLE IF NOT EXISTS alias_history (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        time REAL NOT NULL,
        id TEXT NOT NULL,
        channel TEXT NOT NULL,
        before INTEGER,
        after INTEGER,
        action TEXT NOT NULL,
        actor TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS alias_history_by_id ON alias_history (id, seq)",
    """CREATE TABLE IF NOT EXISTS channels (
        id TEXT NOT NULL REFERENCES adapters(id),
        name TEXT NOT NULL,
        version INTEGER NOT NULL,
        PRIMARY KEY (id, name)
    )""",
    *(
        f"CREATE TRIGGER IF NOT EXISTS {table}_append_only_{op.lower()} BEFORE {op} ON {table} "
        f"BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END"
        for table, op in (("audit", "UPDATE"), ("alias_history", "UPDATE"), ("alias_history", "DELETE"))
    ),
    "CREATE INDEX IF NOT EXISTS audit_by_time ON audit (time)",
)
# Schema 6: an audit row may be deleted once older than the cutoff :func:`prune` records in
# ``meta`` (only ever raised), never a newer one.
_PRUNED_BEFORE = "audit_pruned_before"
RETENTION_SCHEMA = (
    "DROP TRIGGER IF EXISTS audit_append_only_delete",
    "CREATE INDEX IF NOT EXISTS audit_by_time ON audit (time)",
    "CREATE TRIGGER IF NOT EXISTS audit_append_only_delete BEFORE DELETE ON audit "
    f"WHEN OLD.time >= COALESCE((SELECT CAST(value AS REAL) FROM meta WHERE key = '{_PRUNED_BEFORE}'), 0) "
    "BEGIN SELECT RAISE(ABORT, 'audit is append-only within its retention'); END",
)


@dataclass(frozen=True)
class AuditEntry:
    """One row of the audit trail, as stored (``before`` / ``after``: JSON text or None)."""

    seq: int
    time: float  # Unix seconds, UTC
    actor: str | None  # key id (12 hex of the key's sha256), "sighup", or None: an embedded caller
    tenant: str | None  # the adapter's owner when the action ran
    action: str
    adapter: str | None  # the adapter id (None: not about one adapter, e.g. tenants_reload)
    before: str | None
    after: str | None
    outcome: str


@dataclass(frozen=True)
class AliasMove:
    """One move of an alias: ``channel`` ``""`` is the id's own; ``before`` / ``after`` None: none."""

    seq: int
    time: float
    adapter_id: str
    channel: str
    before: int | None
    after: int | None
    action: str
    actor: str | None


@dataclass(frozen=True)
class AuditQuery:
    """Which audit rows to read: every filter optional, newest first, at most ``limit``."""

    adapter: str | None = None
    action: str | None = None
    actor: str | None = None
    since: float | None = None  # Unix seconds: rows at or after
    before_seq: int | None = None  # rows older than this id (paging)
    limit: int = DEFAULT_LIMIT


def append(
    db: sqlite3.Connection,
    now: float,
    actor: str | None,
    action: str,
    adapter: str | None,
    *,
    tenant: str | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    outcome: str = OK,
) -> None:
    """Append one audit row (inside the caller's transaction)."""
    assert action in ACTIONS, action
    db.execute(
        "INSERT INTO audit (time, actor, tenant, action, adapter, before, after, outcome) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (now, actor, tenant, action, adapter, _json(before), _json(after), outcome),
    )


def prune(db: sqlite3.Connection, before: float) -> int:
    """Delete the audit rows older than ``before`` (Unix seconds; inside the caller's
    transaction) and raise the cutoff the trigger allows; the rows deleted."""
    row = db.execute("SELECT CAST(value AS REAL) FROM meta WHERE key = ?", (_PRUNED_BEFORE,)).fetchone()
    cutoff = max(before, row[0] if row else 0.0)
    db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (_PRUNED_BEFORE, repr(cutoff)))
    return db.execute("DELETE FROM audit WHERE time < ?", (cutoff,)).rowcount


def record_move(
    db: sqlite3.Connection,
    now: float,
    adapter_id: str,
    channel: str,
    before: int | None,
    after: int | None,
    action: str,
    actor: str | None,
) -> None:
    """Append one alias move (inside the caller's transaction); a move to where it was is none."""
    if before != after:
        db.execute(
            "INSERT INTO alias_history (time, id, channel, before, after, action, actor) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (now, adapter_id, channel, before, after, action, actor),
        )


def entries(db: sqlite3.Connection, query: AuditQuery) -> list[AuditEntry]:
    """The rows ``query`` selects, newest first."""
    where: list[str] = []
    args: list[str | float | int] = []
    for column, value in (("adapter", query.adapter), ("action", query.action), ("actor", query.actor)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if query.since is not None:
        where.append("time >= ?")
        args.append(query.since)
    if query.before_seq is not None:
        where.append("seq < ?")
        args.append(query.before_seq)
    sql = "SELECT seq, time, actor, tenant, action, adapter, before, after, outcome FROM audit"
    if where:
        sql += " WHERE " + " AND ".join(where)
    rows = db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, query.limit)).fetchall()
    return [AuditEntry(*r) for r in rows]


def moves(db: sqlite3.Connection, adapter_id: str, limit: int | None = None) -> list[AliasMove]:
    """``adapter_id``'s alias moves (every channel), newest first; all of them without ``limit``."""
    rows = db.execute(
        "SELECT seq, time, id, channel, before, after, action, actor FROM alias_history "
        "WHERE id = ? ORDER BY seq DESC LIMIT ?",
        (adapter_id, -1 if limit is None else limit),
    ).fetchall()
    return [AliasMove(*r) for r in rows]


Choose = Callable[[Sequence[AliasMove], int, Collection[int]], int]
"""How a store's move picks its version when it is given none: from the alias's moves (one
channel's, newest first), the version the alias points at and the versions servable there, read
under the store's lock (a rollback: :func:`rollback_version`)."""


def rollback_target(history: Sequence[AliasMove], current: int, existing: Collection[int]) -> int | None:
    """Where a rollback of an alias now at ``current`` goes, given its moves (newest first, one
    channel): the version it pointed at before the newest move onto ``current`` that was not
    itself a rollback. So rollbacks walk back through deploys one at a time (3 -> 2 -> 1), and a
    version since deleted is stepped over to the one before it. With no such move (history
    begins at schema 4: a migrated file knows none), the newest existing version older than
    the version it reached (a deleted one, stepped over). None: nothing to roll back to."""
    target, seen = current, {current}
    while True:
        move = next((m for m in history if m.after == target and m.action != "rollback"), None)
        if move is None:
            older = [v for v in existing if v < target and v != current]
            return max(older) if older else None
        if move.before is None or move.before in seen:
            return None
        if move.before in existing:
            return move.before
        target = move.before
        seen.add(target)


def rollback_version(history: Sequence[AliasMove], current: int, existing: Collection[int], alias: str) -> int:
    """:func:`rollback_target`, or the 409 of an ``alias`` (``id`` or ``id@channel``) with nothing
    left to roll back to."""
    version = rollback_target(history, current, existing)
    if version is None:
        raise ConflictError(
            f"{alias} is at version {current} and no earlier version it served is left to roll back to; "
            'name one with {"version": N}',
            param="version",
        )
    return version


def check_channel(channel: str) -> None:
    """400 for a channel name ``id@{channel}`` could not carry (the id's own alias, ``""``, passes)."""
    if channel and not CHANNEL.fullmatch(channel):
        raise InvalidRequestError(
            f"channel {channel[:40]!r}: 1-32 of a-z, 0-9, '_' and '-', a letter first (so `id@{{channel}}` never "
            "reads as a version number)",
            param="channel",
        )


def channel_name(name: str) -> str | None:
    """The channel a model name's suffix names (``id@prod`` -> ``prod``), or None."""
    _, at, suffix = name.rpartition("@")
    return suffix if at and CHANNEL.fullmatch(suffix) else None


def _json(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), sort_keys=True)

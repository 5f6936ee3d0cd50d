"""What a base upgrade keeps per adapter: its check prompts, and its migration state per new base.

Two tables in the registry's SQLite file (schema 5; :class:`~lorapage.registry.store.Registry`
calls the functions here inside its lock and transaction, as it does :mod:`lorapage.registry.audit`'s):

- ``check_prompts``: per adapter id, its stored check prompts (a JSON list of strings, bounded by
  :data:`MAX_CHECK_PROMPTS` prompts of at most :data:`MAX_PROMPT_BYTES` UTF-8 bytes each), whether
  its owner lets the server sample more from its traffic (``sample``), and whether the owner
  opted out of base migrations (``opt_out``). Given at registration (``check_prompts``) or by
  ``PUT /v1/adapters/{id}/check_prompts``; and ``sampled``: at most :data:`MAX_SAMPLED_PROMPTS`
  prompts of the adapter's own traffic (:mod:`lorapage.frontend.prompt_sampler`), deleted when the
  owner turns sampling off. Prompt text lives here only, never in a log.
- ``migrations``: per adapter version and target base digest, its state (:data:`STATES`), the
  drift numbers of its last check (JSON of :class:`~lorapage.bases.drift.DriftReport`'s fields),
  the customer notice, the validation job that wrote it and, once migrated, the version bound to
  the new base (``new_version``).

A migrated version is a new row of ``versions`` (same content and source, the new base's digest);
an engine on the new base resolves the id's alias (and its channels) through that row: see
:meth:`~lorapage.registry.catalog.AdapterCatalog.resolve`.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lorapage.errors import InvalidRequestError

MAX_CHECK_PROMPTS = 100  # per adapter id: enough for a drift estimate, small enough to check in seconds
MAX_PROMPT_BYTES = 4096  # per prompt, UTF-8
MAX_SAMPLED_PROMPTS = 16  # per adapter id, sampled from its traffic (its owner opted in), newest kept
# A body carrying prompts up to the bounds (JSON may escape each byte as \\uXXXX): what
# ``PUT /v1/adapters/{id}/check_prompts`` reads at most (a registration keeps the admin routes' 64 KiB).
CHECK_PROMPTS_BODY_BYTES = 4 << 20

PENDING, PASSED, FAILED, MIGRATED, OPTED_OUT = "pending", "passed", "failed", "migrated", "opted-out"
STATES = (PENDING, PASSED, FAILED, MIGRATED, OPTED_OUT)

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS check_prompts (
        id TEXT PRIMARY KEY,
        prompts TEXT NOT NULL,
        sample INTEGER NOT NULL DEFAULT 0,
        opt_out INTEGER NOT NULL DEFAULT 0,
        sampled TEXT NOT NULL DEFAULT '[]',
        updated REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS migrations (
        id TEXT NOT NULL,
        version INTEGER NOT NULL,
        target TEXT NOT NULL,
        state TEXT NOT NULL,
        reason TEXT,
        numbers TEXT,
        notice TEXT,
        job TEXT,
        new_version INTEGER,
        updated REAL NOT NULL,
        PRIMARY KEY (id, version, target)
    )""",
)


@dataclass(frozen=True)
class CheckPrompts:
    """An adapter id's check settings as stored."""

    adapter_id: str
    prompts: tuple[str, ...] = ()
    sample: bool = False  # the owner lets the server add prompts sampled from its traffic
    opt_out: bool = False  # the owner opted out of base migrations: never checked, never moved
    sampled: tuple[str, ...] = ()  # sampled from its traffic while ``sample`` is on, newest first

    def all_prompts(self) -> tuple[str, ...]:
        """What its drift check runs: the given prompts, then the sampled ones."""
        return self.prompts + (self.sampled if self.sample else ())

    def updated(self, prompts: Sequence[str] | None, sample: bool | None, opt_out: bool | None) -> CheckPrompts:
        """These settings with what is given replaced (None: kept); turning sampling off deletes
        what was sampled."""
        on = self.sample if sample is None else sample
        return CheckPrompts(
            self.adapter_id,
            self.prompts if prompts is None else tuple(prompts),
            on,
            self.opt_out if opt_out is None else opt_out,
            self.sampled if on else (),
        )


@dataclass(frozen=True)
class MigrationRow:
    """One adapter version's migration toward base ``target`` (a stored digest)."""

    adapter_id: str
    version: int
    target: str
    state: str  # one of STATES
    reason: str | None  # why it is pending or failed, in words
    numbers: dict[str, Any] | None  # the DriftReport's fields
    notice: str | None  # what the customer is told
    job: str | None
    new_version: int | None  # the version bound to ``target`` once migrated
    updated: float

    @property
    def key(self) -> str:
        return f"{self.adapter_id}@{self.version}"


class DriftRecord(Protocol):
    """Where check prompts, sampled prompts and migration states are kept: the registry of an
    engine (``engine.admin.drift_record``) or of a fleet's ingress. Its calls block (SQLite): run
    them in a worker thread."""

    def check_prompts(self, adapter_id: str) -> CheckPrompts: ...

    def set_check_prompts(self, value: CheckPrompts, *, actor: str | None = None) -> None: ...

    def sampling_ids(self) -> list[str]: ...

    def add_sampled_prompts(self, adapter_id: str, prompts: Sequence[str]) -> int: ...

    def migration_states(self, target: str | None = None, adapter_id: str | None = None) -> list[MigrationRow]: ...

    def set_migration_states(self, rows: Iterable[MigrationRow]) -> None: ...


def check_prompts_param(prompts: Sequence[object], param: str = "check_prompts") -> tuple[str, ...]:
    """``prompts`` as stored, or 400 naming the bound it breaks (count, type, size, emptiness)."""
    if len(prompts) > MAX_CHECK_PROMPTS:
        raise InvalidRequestError(
            f"{len(prompts)} check prompts given; an adapter keeps at most {MAX_CHECK_PROMPTS}", param=param
        )
    out = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError(f"{param}[{i}] must be a non-empty string", param=param)
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > MAX_PROMPT_BYTES:
            raise InvalidRequestError(
                f"{param}[{i}] is {size} bytes; a check prompt is at most {MAX_PROMPT_BYTES} bytes (UTF-8)",
                param=param,
            )
        out.append(prompt)
    return tuple(out)


def read_prompts(db: sqlite3.Connection, adapter_id: str) -> CheckPrompts:
    row = db.execute(
        "SELECT prompts, sample, opt_out, sampled FROM check_prompts WHERE id = ?", (adapter_id,)
    ).fetchone()
    if row is None:
        return CheckPrompts(adapter_id)
    return CheckPrompts(adapter_id, tuple(json.loads(row[0])), bool(row[1]), bool(row[2]), tuple(json.loads(row[3])))


def write_prompts(db: sqlite3.Connection, now: float, value: CheckPrompts) -> None:
    """Store ``value`` whole; with ``sample`` off, nothing sampled is kept."""
    sampled = list(value.sampled[:MAX_SAMPLED_PROMPTS]) if value.sample else []
    db.execute(
        "INSERT INTO check_prompts (id, prompts, sample, opt_out, sampled, updated) VALUES (?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET prompts = excluded.prompts, sample = excluded.sample, "
        "opt_out = excluded.opt_out, sampled = excluded.sampled, updated = excluded.updated",
        (
            value.adapter_id,
            json.dumps(list(value.prompts)),
            int(value.sample),
            int(value.opt_out),
            json.dumps(sampled),
            now,
        ),
    )


def sampling_ids(db: sqlite3.Connection) -> list[str]:
    """The ids whose owners let the server sample their traffic."""
    return [r[0] for r in db.execute("SELECT id FROM check_prompts WHERE sample = 1 ORDER BY id")]


_COLUMNS = "id, version, target, state, reason, numbers, notice, job, new_version, updated"


def write_state(db: sqlite3.Connection, now: float, row: MigrationRow) -> None:
    assert row.state in STATES, row.state
    db.execute(
        f"INSERT OR REPLACE INTO migrations ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            row.adapter_id,
            row.version,
            row.target,
            row.state,
            row.reason,
            None if row.numbers is None else json.dumps(row.numbers, sort_keys=True),
            row.notice,
            row.job,
            row.new_version,
            now,
        ),
    )


def read_states(db: sqlite3.Connection, target: str | None = None, adapter_id: str | None = None) -> list[MigrationRow]:
    """Migration rows toward ``target`` (every target: None), of ``adapter_id`` (every id: None)."""
    where, args = [], []
    for column, value in (("target", target), ("id", adapter_id)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    sql = f"SELECT {_COLUMNS} FROM migrations" + (" WHERE " + " AND ".join(where) if where else "")
    rows = db.execute(sql + " ORDER BY id, version", args).fetchall()
    return [
        MigrationRow(r[0], r[1], r[2], r[3], r[4], None if r[5] is None else json.loads(r[5]), *r[6:]) for r in rows
    ]

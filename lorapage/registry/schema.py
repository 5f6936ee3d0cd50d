"""The adapter registry's SQLite schema (:class:`~lorapage.registry.store.Registry`).

Tables:
- ``adapters``: one row per id ever registered: its owner tenant, the version its alias points at
  (``current``, NULL once every version is deleted) and the next version number. The row outlives
  its versions so a number is never reused: ``id@3`` names the same bytes for good.
- ``versions``: ``(id, version)`` with the content digest, the canonical source URI, the base
  digest it was validated against and the adapter's spec (JSON: ranks and scales per module), so
  a restart restores every version without reading or downloading any weights; whether an
  admin pinned it resident (``pinned``, schema 2), so a restart loads it again; and its projected
  decode cost in % of the base's (``projected_cost_pct``, schema 3; see
  :mod:`lorapage.adapters.cost`), so "which adapters are expensive" is a query.
- ``audit``, ``alias_history`` (append-only) and ``channels`` (schema 4): every change above with
  who made it, each alias's moves, and the named channels (``id@prod``) an id has; see
  :mod:`lorapage.registry.audit`. Each write method appends its rows in its own transaction.
- ``adapter_traffic`` (schema 4): per version and calendar hour (``hour``: hours since the Unix
  epoch, UTC), its requests, prompt tokens and output tokens. The engine adds to it in batches
  (:meth:`Registry.add_traffic`, off its event loop) and hours past the retention are deleted in
  the same transaction; the traffic tiers (:mod:`lorapage.adapters.tiers`) are read from it, so
  they survive a restart. Rows outlive a deleted version until the retention takes them (its
  number is never reused).
- ``check_prompts`` and ``migrations`` (schema 5): each adapter id's stored check prompts and
  opt-ins, and each version's migration state toward a new base, with its drift numbers; see
  :mod:`lorapage.registry.drift_state`. A migration (:meth:`Registry.migrate_version`) adds a
  ``versions`` row bound to the new base, its state and its audit row in one transaction.

Older files are migrated in place when opened, each step in the transaction that records the new
schema: schema 1 (before pins) gains ``pinned`` (0 for every version), schema 2 gains
``projected_cost_pct`` (NULL until an engine on that base fills it in at start), schema 3 gains
the audit tables (empty: history begins there; a rollback of an alias with no history goes to the
newest older version) and the ``adapter_traffic`` table (empty), schema 4 the check-prompt and
migration tables (empty), schema 5 the audit trail's retention (:meth:`Registry.prune_audit`).
"""

from __future__ import annotations

from lorapage.registry import audit, drift_state

SCHEMA_VERSION = 6

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS adapters (
    id TEXT PRIMARY KEY,
    owner TEXT,
    current INTEGER,
    next_version INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    id TEXT NOT NULL REFERENCES adapters(id),
    version INTEGER NOT NULL,
    digest TEXT NOT NULL,
    source TEXT NOT NULL,
    base_digest TEXT NOT NULL,
    spec TEXT NOT NULL,
    created REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    projected_cost_pct REAL,
    PRIMARY KEY (id, version)
);
"""
# -- the traffic table (schema 4): kept apart, its own statements, created fresh or by migration --
TRAFFIC_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS adapter_traffic (
    id TEXT NOT NULL,
    version INTEGER NOT NULL,
    hour INTEGER NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (id, version, hour)
) WITHOUT ROWID""",
    # Pruning and "the last 24 hours" read by hour.
    "CREATE INDEX IF NOT EXISTS adapter_traffic_hour ON adapter_traffic (hour)",
)
# Each step takes a file from schema N to N + 1 (N is the key).
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("ALTER TABLE versions ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0",),
    2: ("ALTER TABLE versions ADD COLUMN projected_cost_pct REAL",),
    3: (*audit.SCHEMA, *TRAFFIC_SCHEMA),
    4: drift_state.SCHEMA,
    5: audit.RETENTION_SCHEMA,
}

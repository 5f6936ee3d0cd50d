"""Registry files as an older lorapage wrote them, for the migration tests: the tables of that
schema, written by hand (not by today's code), with the rows a test gives."""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA_3 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE adapters (id TEXT PRIMARY KEY, owner TEXT, current INTEGER,
                       next_version INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE versions (id TEXT NOT NULL REFERENCES adapters(id), version INTEGER NOT NULL,
                       digest TEXT NOT NULL, source TEXT NOT NULL, base_digest TEXT NOT NULL,
                       spec TEXT NOT NULL, created REAL NOT NULL, pinned INTEGER NOT NULL DEFAULT 0,
                       projected_cost_pct REAL, PRIMARY KEY (id, version));
INSERT INTO meta VALUES ('schema', '3');
"""


def schema_3_file(path: Path, rows: str) -> None:
    """Write a schema-3 registry at ``path`` holding ``rows`` (INSERT statements)."""
    db = sqlite3.connect(path)
    db.executescript(SCHEMA_3 + rows)
    db.commit()
    db.close()

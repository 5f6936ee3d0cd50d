"""The registry's hourly traffic table (real SQLite): counts added in batches, hours past the
retention deleted as rows are written, a schema-3 file migrated in place; the usage ledger's
counts that feed it, taken and given back."""

from __future__ import annotations

import sqlite3

import pytest
from registry_files import schema_3_file

from lorapage.adapters.names import parse_name
from lorapage.adapters.tiers import recent_requests, window_weights
from lorapage.engine.tiering import traffic_rows
from lorapage.registry.store import SCHEMA_VERSION, Registry, TrafficRow
from lorapage.usage import StepRow, UsageLedger
from lorapage.usage.ledger import HOUR_S

H = 490_000  # an hour since the epoch


def test_counts_add_up_per_version_and_hour_and_survive_a_reopen(tmp_path):
    path = tmp_path / "registry.sqlite3"
    registry = Registry(path)
    registry.add_traffic([TrafficRow("a", 1, H, 2, 30, 8), TrafficRow("a", 2, H, 1, 5, 1)], H)
    registry.add_traffic([TrafficRow("a", 1, H, 3, 10, 4), TrafficRow("b", 1, H - 1, 1, 1, 1)], H)
    registry.close()
    registry = Registry(path)
    assert registry.traffic(H - 5) == [
        TrafficRow("a", 1, H, 5, 40, 12),
        TrafficRow("a", 2, H, 1, 5, 1),
        TrafficRow("b", 1, H - 1, 1, 1, 1),
    ]
    assert [r.key for r in registry.traffic(H - 5, "b")] == ["b@1"]
    assert registry.traffic(H) == [TrafficRow("a", 1, H, 5, 40, 12), TrafficRow("a", 2, H, 1, 5, 1)]
    registry.close()


def test_hours_past_the_retention_are_deleted_as_rows_are_written(tmp_path):
    registry = Registry(tmp_path / "registry.sqlite3")
    registry.add_traffic([TrafficRow("a", 1, H - h, 1) for h in range(40)], H, retention_hours=30)
    assert min(r.hour for r in registry.traffic(0)) == H - 30  # nothing older was even stored
    registry.add_traffic([TrafficRow("a", 1, H + 5, 1)], H + 5, retention_hours=30)  # five hours on
    hours = sorted(r.hour for r in registry.traffic(0))
    assert hours == [*range(H - 25, H + 1), H + 5]
    registry.close()


def test_the_windows_summed_in_sqlite_are_the_tier_rules_own(tmp_path):
    registry = Registry(tmp_path / "registry.sqlite3")
    counts = {"a@1": {H: 7, H - 1: 10, H - 24: 8, H - 30: 99}, "a@2": {H - 3: 5}, "b@1": {H - 40: 3}}
    rows = []
    for key, hours in counts.items():
        adapter_id, version = parse_name(key)
        rows += [TrafficRow(adapter_id, version or 0, h, n) for h, n in hours.items()]
    registry.add_traffic(rows, H)
    now = H * HOUR_S + 900.0  # a quarter past H
    got = registry.weighted_requests(window_weights(now))
    want = recent_requests(counts, now)
    assert got.keys() == {"a@1", "a@2"}  # b@1 had nothing in the last 25 hours
    for key in got:
        assert got[key] == pytest.approx(want[key])
    assert got["a@1"] == pytest.approx((7 + 10 * 0.75, 7 + 10 + 8 * 0.75))
    registry.close()


def test_a_schema_3_registry_gains_the_traffic_table_and_keeps_its_versions(tmp_path):
    path = tmp_path / "registry.sqlite3"
    schema_3_file(
        path,
        """
        INSERT INTO adapters VALUES ('acme', 'alpha', 1, 2, 1.0);
        INSERT INTO versions VALUES ('acme', 1, 'd', 'file:///x', 'b', '{}', 1.0, 1, 2.5);
        """,
    )
    registry = Registry(path)
    (row,) = registry.versions()
    assert (row.key, row.pinned, row.projected_cost_pct) == ("acme@1", True, 2.5)
    assert registry.traffic(0) == []
    registry.add_traffic([TrafficRow("acme", 1, H, 4, 40, 9)], H)
    registry.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (str(SCHEMA_VERSION),) == ("6",)
    assert db.execute("SELECT id, version, hour, requests FROM adapter_traffic").fetchall() == [("acme", 1, H, 4)]
    indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "adapter_traffic_hour" in indexes
    db.close()
    Registry(path).close()  # a schema-4 file opens as it is


def test_the_ledger_counts_adapters_traffic_per_hour_until_taken():
    ledger = UsageLedger()
    now = H * HOUR_S + 10.0
    ledger.record_request(now, "alpha", "acme@1")
    ledger.record_request(now, "alpha", "")  # the base: no adapter traffic
    ledger.record_request(now + HOUR_S, "beta", "acme@1")
    ledger.record_step(now, 0.01, [StepRow("alpha", "acme@1", 7, 0, 2), StepRow("alpha", "", 3, 0, 1)])
    ledger.record_step(now + 1, 0.01, [StepRow("alpha", "acme@1", 0, 1, 2)])
    taken = ledger.take_traffic()
    assert traffic_rows(taken) == [TrafficRow("acme", 1, H, 1, 7, 1), TrafficRow("acme", 1, H + 1, 1, 0, 0)]
    assert ledger.take_traffic() == {}
    ledger.record_request(now, "alpha", "acme@1")
    ledger.restore_traffic(taken)  # a write that failed gives them back, added to the new counts
    assert traffic_rows(ledger.take_traffic()) == [
        TrafficRow("acme", 1, H, 2, 7, 1),
        TrafficRow("acme", 1, H + 1, 1, 0, 0),
    ]

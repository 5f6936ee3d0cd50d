"""The version index both front ends keep over the SQLite registry (``adapters/version_index.py``).

A real registry file in a temporary directory: every change is committed to it first and then
applied to the index, as the catalog and the fleet registry do, and after each step the index
equals one loaded afresh from the file (what a restart would show).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lorapage.errors import AdapterNotFoundError, ConflictError
from lorapage.registry.store import REGISTRY_FILE, Registry, VersionRow
from lorapage.registry.version_index import VersionIndex

BASE = "b" * 64


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(tmp_path / REGISTRY_FILE)


def register(registry: Registry, index: VersionIndex, adapter_id: str, owner: str | None, *, activate=True):
    """A new version committed, then shown (its content differs from every other's)."""
    digest = f"{adapter_id}-{len(index.versions(adapter_id)) + 1}".ljust(64, "0")
    row = registry.add_version(
        adapter_id, owner, digest=digest, source="file:///x", base_digest=BASE, spec="{}", activate=activate
    )
    index.add(row, owner, activate=activate)
    return row


def as_restarted(index: VersionIndex, registry: Registry) -> None:
    """The live index shows what the registry stores."""
    fresh = VersionIndex.load(registry)
    assert index.stored() == fresh.stored()
    assert {i: index.channels(i) for i in index.ids()} == {i: fresh.channels(i) for i in fresh.ids()}


def keys(rows: list[VersionRow]) -> list[str]:
    return [r.key for r in rows]


def test_a_name_finds_its_version_by_id_number_or_channel(registry: Registry) -> None:
    index = VersionIndex.load(registry)
    v1 = register(registry, index, "a", "t1")
    v2 = register(registry, index, "a", "t1")
    v3 = register(registry, index, "a", "t1", activate=False)
    registry.set_channel("a", "prod", 3, action="deploy", actor=None)
    index.set_channel("a", "prod", 3)

    assert index.row("a") == v2  # the alias: the current version
    assert index.row("a@3") == v3
    assert index.row("a@prod") == v3
    assert index.row("a@1") == v1
    assert index.row("a@9") is None  # no such version
    assert index.row("a@staging") is None  # no such channel
    assert index.row("a@1x") is None  # neither a number nor a channel
    assert index.row("b") is None and index.lookup("b") == (None, None)
    row, entry = index.lookup("a@prod")
    assert row == v3 and entry is index.lookup("a")[1] and entry is not None and entry.current == 2
    assert index.version("a", 3) == v3 and index.version("a", None) is None and index.version("a", -1) is None
    assert index.find("a", lambda r: r.digest == v2.digest) == v2
    assert index.ids() == ["a"] and index.current("a") == 2 and keys(index.versions("a")) == ["a@1", "a@2", "a@3"]
    as_restarted(index, registry)


def test_an_alias_at_a_version_of_another_base_serves_its_migration(registry: Registry) -> None:
    index = VersionIndex.load(registry)
    old = register(registry, index, "a", None)
    registry.set_channel("a", "prod", 1, action="deploy", actor=None)
    index.set_channel("a", "prod", 1)
    migrated = register(registry, index, "a", None, activate=False)
    index.migrations = {("a", old.version): migrated.version}

    assert index.row("a") == migrated and index.row("a@prod") == migrated  # aliases follow
    assert index.row("a@1") == old  # a version named exactly stays itself
    assert index.current("a") == 1 and index.serving("a") == 2


def test_alias_and_channel_moves_and_where_a_rollback_starts(registry: Registry) -> None:
    index = VersionIndex.load(registry)
    register(registry, index, "a", None)
    register(registry, index, "a", None)
    registry.set_current("a", 1, action="rollback")
    index.set_current("a", 1)
    registry.set_channel("a", "canary", 2, action="deploy", actor=None)
    index.set_channel("a", "canary", 2)
    assert index.at("a", "") == 1 and index.at("a", "canary") == 2
    assert index.channels("a") == {"canary": 2} and index.channels("nobody") == {}
    as_restarted(index, registry)

    with pytest.raises(AdapterNotFoundError, match="adapter 'a' has no channel 'prod'"):
        index.at("a", "prod")
    with pytest.raises(AdapterNotFoundError, match=r"adapter 'a@7' does not exist") as missing:
        index.existing("a", 7)
    assert missing.value.param == "version"
    with pytest.raises(AdapterNotFoundError, match="does not exist; name the id, not a version"):
        index.require("a@1")

    registry.set_channel("a", "canary", None, action="channel", actor=None)
    index.set_channel("a", "canary", None)
    assert index.channels("a") == {}
    as_restarted(index, registry)


def test_deleting_versions_moves_the_alias_and_drops_their_channels(registry: Registry) -> None:
    index = VersionIndex.load(registry)
    for _ in range(3):
        register(registry, index, "a", "t1")
    registry.set_current("a", 2)
    index.set_current("a", 2)
    registry.set_channel("a", "old", 1, action="deploy", actor=None)
    index.set_channel("a", "old", 1)

    for version in (2, 1):  # the alias's version alone first: the alias moves to the newest left
        with pytest.raises(ConflictError):
            index.removable(f"a@{version}")  # the current one, then the channel's, are refused
        registry.delete_version("a", version, index.current_without("a", version))
        index.remove("a", version)
        as_restarted(index, registry)
    assert index.current("a") == 3 and index.channels("a") == {} and keys(index.versions("a")) == ["a@3"]

    assert index.removable("a@3") == ["a@3"]  # the only version: removable
    registry.delete_version("a", 3, index.current_without("a", 3))
    index.remove("a", 3)
    as_restarted(index, registry)
    assert index.ids() == [] and index.owner("a") is None and index.current("a") is None
    index.check_owner("a", "t2")  # an id with no versions left is free for another tenant


def test_what_a_delete_removes_and_what_it_refuses(registry: Registry) -> None:
    index = VersionIndex.load(registry)
    for _ in range(3):
        register(registry, index, "a", None)
    registry.set_channel("a", "prod", 2, action="deploy", actor=None)
    index.set_channel("a", "prod", 2)

    assert index.removable("a") == ["a@1", "a@2", "a@3"]
    assert index.removable("a@1") == ["a@1"]
    with pytest.raises(ConflictError, match="a@3 is the version 'a' serves; point the alias"):
        index.removable("a@3")
    with pytest.raises(ConflictError, match="a@2 is the version channel 'prod' serves"):
        index.removable("a@2")
    for name in ("a@9", "nobody", "nobody@1"):
        with pytest.raises(AdapterNotFoundError, match=f"adapter {name!r} does not exist"):
            index.removable(name)


def test_an_id_belongs_to_the_tenant_that_first_registered_it(registry: Registry) -> None:
    index = VersionIndex.load(registry)
    register(registry, index, "a", "t1")
    index.check_owner("a", "t1")
    index.check_owner("new", "t2")  # unknown ids are anyone's
    with pytest.raises(ConflictError, match="adapter id 'a' belongs to another tenant; choose another id"):
        index.check_owner("a", "t2")
    with pytest.raises(ConflictError):
        index.check_owner("a", None)
    assert VersionIndex.load(registry).owner("a") == "t1"  # kept over a restart


def test_every_change_counts_and_marks_what_a_mirror_copies(registry: Registry) -> None:
    index = VersionIndex.load(registry, generation=1)
    row = register(registry, index, "a", None)
    assert index.generation == 2 and index.changed == {"a": 2}
    registry.set_pinned("a", 1, True)
    index.set_pinned("a", 1, True)
    assert index.version("a", 1) == dataclasses.replace(row, pinned=True)
    assert index.generation == 3 and index.changed == {"a": 3}
    registry.set_channel("a", "prod", 1, action="deploy", actor=None)
    index.set_channel("a", "prod", 1)  # mirrors copy no channels: counted, the id not marked
    assert index.generation == 4 and index.changed == {"a": 3}
    index.count()
    assert index.generation == 5
    as_restarted(index, registry)
    assert VersionIndex.load(registry, generation=1).changed == {"a": 1}  # loaded: every id at the start


def test_a_mirror_takes_another_registry_s_word_and_keeps_what_is_in_use(registry: Registry) -> None:
    index = VersionIndex.load(registry)
    r1 = register(registry, index, "a", None)
    register(registry, index, "a", None)
    r3 = VersionRow("a", 3, "c" * 64, "file:///y", BASE, "{}", 0.0)
    index.mirror("a", "t9", 3, [r3], keep={1})  # version 1 still runs requests here: kept
    assert keys(index.versions("a")) == ["a@1", "a@3"] and index.owner("a") == "t9" and index.current("a") == 3
    assert index.row("a") == r3 and index.version("a", 1) == r1 and index.version("a", 2) is None
    index.mirror("a", "t9", 3, [r3], keep=set())
    assert index.versions("a") == [r3]
    index.mirror("a", None, None, [], keep=set())  # gone there: forgotten here
    assert index.lookup("a")[1] is None and index.ids() == []

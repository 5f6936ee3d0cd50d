"""One writer per state dir (issue 26, case 9): two engines on one ``--state-dir`` (a rolling
restart) recorded the wrong owner, so after a restart tenant A was served B's content. Now the
second one refuses to start, and a registry written by another process anyway refuses an owner
change inside the registration's own transaction. Real SQLite, real locks."""

from __future__ import annotations

import pytest
from engine_util import collect

from lorapage import Engine, EngineConfig
from lorapage.adapters.state_lock import StateDirError
from lorapage.errors import ConflictError
from lorapage.registry.store import REGISTRY_FILE, Registry
from lorapage.sampling_params import SamplingParams
from lorapage.tiny import DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs


def _engine(state: str) -> Engine:
    return Engine(EngineConfig(model=str(TINY_BASE_DIR), block_size=4, state_dir=state))


async def test_a_second_engine_on_one_state_dir_refuses_to_start(tmp_path):
    state = str(tmp_path / "state")
    first = _engine(state)
    try:
        with pytest.raises(StateDirError, match=r"is in use by another lorapage process \(pid \d+\)") as info:
            _engine(state)
        assert "\n" not in str(info.value)
        await first.register_adapter("a", demo_adapter_dirs()["acme"], owner="alpha")
    finally:
        await first.close()
    again = _engine(state)  # the first one is gone: the dir is free, its registrations kept
    try:
        assert again.admin.catalog.owners().get("a") == "alpha"
        out, _ = await collect(again, "Hi", "a", SamplingParams(max_tokens=40, temperature=0.0))
        assert out.text == DEMO_MARKERS["acme"]
    finally:
        await again.close()


def test_an_owner_change_is_refused_inside_the_registration_transaction(tmp_path):
    """Two registries on one file, as two processes would hold it: the second's registration of
    an id the first gave alpha is refused for beta, and nothing of it is stored; once every
    version is deleted the id is free for anyone."""
    path = tmp_path / REGISTRY_FILE
    old, new = Registry(path), Registry(path)
    try:
        version = {"digest": "a" * 64, "source": "file:///a", "base_digest": "b" * 64, "spec": "{}", "activate": True}
        old.add_version("shared-id", "alpha", **version)
        with pytest.raises(ConflictError, match="belongs to another tenant"):
            new.add_version("shared-id", "beta", **version | {"digest": "c" * 64})
        with pytest.raises(ConflictError):
            new.add_version("shared-id", None, **version | {"digest": "c" * 64})  # nor made shared
        assert [(r.adapter_id, r.version, r.digest) for r in new.versions()] == [("shared-id", 1, "a" * 64)]
        assert [(a.adapter_id, a.owner, a.current) for a in new.adapters()] == [("shared-id", "alpha", 1)]
        new.add_version("shared-id", "alpha", **version | {"digest": "d" * 64})  # its owner may
        old.delete_version("shared-id", 1, 2)
        new.delete_version("shared-id", 2, None)
        row = new.add_version("shared-id", "beta", **version)  # free again; numbers are never reused
        assert row.version == 3 and [(a.owner, a.current) for a in old.adapters()] == [("beta", 3)]
    finally:
        old.close()
        new.close()

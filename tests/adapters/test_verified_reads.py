"""A weights file hashed once is known again by its stamp (lorapage.adapters.verified): only a file
no one but the server's user (or root) can write, settled when it was hashed, and never across a
change of its bytes, its inode or its times. Real files of the tiny model's demo adapters."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

import lorapage.adapters.loader as loader_module
from lorapage import Engine, EngineConfig
from lorapage.adapters.checks import AdapterChecks
from lorapage.adapters.digest import content_digest
from lorapage.adapters.loader import AdapterLoader
from lorapage.adapters.peft_format import read_adapter_spec
from lorapage.adapters.verified import FileStamp, VerifiedFiles
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def checks() -> AdapterChecks:
    """The tiny engine's registration checks and, through them, its loader."""
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), max_loras=2, max_lora_rank=64, block_size=4))
    return engine.debug.adapters.checks


@pytest.fixture
def loader(checks: AdapterChecks) -> AdapterLoader:
    return checks.loader


@pytest.fixture
def hashes(monkeypatch) -> list[int]:
    """Counts the loader's sha256 passes over an adapter's bytes."""
    calls: list[int] = []
    real = loader_module.bytes_digest

    def counted(contents):
        calls.append(1)
        return real(contents)

    monkeypatch.setattr(loader_module, "bytes_digest", counted)
    return calls


def _adapter(tmp_path: Path, mode: int = 0o644) -> Path:
    path = shutil.copytree(demo_adapter_dirs()["acme"], tmp_path / "acme")
    (path / WEIGHTS).chmod(mode)
    return path


def _validate(checks: AdapterChecks, path: Path) -> str:
    """The directory's digest as a load's read finds it (registration's check reads the same way)."""
    return checks.loader.read_verified(read_adapter_spec(str(path), checks.model, 64))[1]


def _change_one_weight(path: Path) -> None:
    """The same size, other content: a weight zeroed in place, a tick after the last write."""
    time.sleep(0.05)
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-4:] = bytes(4)
    with (path / WEIGHTS).open("r+b") as f:
        f.write(data)


def test_a_file_only_this_user_can_write_is_hashed_once(checks, loader, hashes, tmp_path):
    path = _adapter(tmp_path)
    loader.verified = VerifiedFiles(settle_ns=0)
    digest = content_digest(path)
    assert [_validate(checks, path) for _ in range(3)] == [digest] * 3
    assert len(hashes) == 1 and loader.verified.hits == 2


def test_a_changed_file_is_hashed_again_whatever_its_times_say(checks, loader, hashes, tmp_path):
    """Rewritten in place, then replaced by a copy of the original bytes' other content with the
    old times put back (utime sets mtime, never ctime; the copy is another inode): every change
    is hashed again, and the digest returned is the bytes' own, which a load holds against the
    registered one."""
    path = _adapter(tmp_path)
    loader.verified = VerifiedFiles(settle_ns=0)
    digest = _validate(checks, path)
    before = os.stat(path / WEIGHTS)
    _change_one_weight(path)
    changed = _validate(checks, path)
    assert changed != digest and changed == content_digest(path)
    os.utime(path / WEIGHTS, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert _validate(checks, path) == changed  # ctime moved with utime: hashed again
    replacement = tmp_path / "replacement"
    shutil.copy2(demo_adapter_dirs()["acme"] / WEIGHTS, replacement)
    os.replace(replacement, path / WEIGHTS)
    os.utime(path / WEIGHTS, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert _validate(checks, path) == digest
    assert len(hashes) == 4 and loader.verified.hits == 0


@pytest.mark.parametrize("mode", [0o664, 0o646])
def test_a_file_others_may_write_is_hashed_at_every_read(checks, loader, hashes, tmp_path, mode):
    path = _adapter(tmp_path, mode)
    loader.verified = VerifiedFiles(settle_ns=0)
    assert _validate(checks, path) == _validate(checks, path) == content_digest(path)
    assert len(hashes) == 2 and loader.verified.hits == 0


def test_a_file_written_within_the_settle_time_is_not_remembered(checks, loader, hashes, tmp_path):
    """Bytes hashed within a timestamp tick of a write could be followed by a write the stamp misses."""
    path = _adapter(tmp_path)
    loader.verified = VerifiedFiles(settle_ns=60_000_000_000)
    _validate(checks, path)
    _validate(checks, path)
    assert len(hashes) == 2 and loader.verified.hits == 0


def test_a_stamp_is_none_when_the_file_changed_while_read_and_trusts_only_its_user_or_root(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x")
    time.sleep(0.05)
    b.write_bytes(b"y")
    now = time.time_ns()
    assert FileStamp.of(os.stat(a), os.stat(b), now) is None
    stamp = FileStamp.of(os.stat(a), os.stat(a), now)
    assert stamp is not None and stamp.others_cannot_write(os.geteuid())
    assert FileStamp(stamp.identity, 0, stamp.mode, now).others_cannot_write(os.geteuid())
    assert not FileStamp(stamp.identity, os.geteuid() + 1, stamp.mode, now).others_cannot_write(os.geteuid())
    assert stamp.settled(0) and not stamp.settled(60_000_000_000)

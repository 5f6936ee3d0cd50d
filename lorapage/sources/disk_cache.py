"""The content-addressed disk cache of downloaded adapters: ``<root>/<digest>/`` holds the two
adapter files, and only bytes that matched their digest are ever renamed in.

Bookkeeping (:class:`DiskCache`) runs on the event loop and touches no disk; the module
functions do the blocking file work and run in a worker. A download is written to a
``.tmp-*`` directory beside the entries and renamed into place whole, so a crash leaves either a
complete entry or a temp directory that the next start removes. An evicted entry is first
renamed to ``.trash-*`` (atomic), then deleted.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path

from lorapage.adapters.digest import ADAPTER_FILES

_DIGEST_NAME = re.compile(r"[0-9a-f]{64}")
_TEMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


class DiskCache:
    """Which digests the cache holds, their bytes, least recently used first, under a byte cap.

    Eviction runs only when an entry is inserted: least recently used entries go until the bytes
    fit the cap, except the one just inserted and those the caller protects (fetches that are
    returning them or reading them). When everything left is protected the cache stays over its
    cap until the next insert.
    """

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, oldest use first
        self.bytes_used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def path(self, digest: str) -> Path:
        return self.root / digest

    def contains(self, digest: str) -> bool:
        """Whether ``digest`` is cached (its recency unchanged)."""
        return digest in self._entries

    def lookup(self, digest: str) -> Path | None:
        """The entry's directory, now the most recently used, or None when not cached."""
        if digest not in self._entries:
            return None
        self._entries.move_to_end(digest)
        return self.path(digest)

    def insert(self, digest: str, size: int, protect: Collection[str]) -> list[str]:
        """Record ``digest`` as the most recently used entry; the digests evicted to fit the cap
        (forgotten here; the caller deletes their directories)."""
        if digest not in self._entries:
            self.bytes_used += size
            self._entries[digest] = size
        self._entries.move_to_end(digest)
        victims = []
        for old in list(self._entries):
            if self.bytes_used <= self.capacity_bytes:
                break
            if old != digest and old not in protect:
                self.forget(old)
                victims.append(old)
        return victims

    def forget(self, digest: str) -> None:
        self.bytes_used -= self._entries.pop(digest, 0)


def open_cache(root: Path, capacity_bytes: int) -> tuple[DiskCache, list[Path]]:
    """The cache over what ``root`` holds, oldest use (directory mtime) first, and the entries
    that did not fit ``capacity_bytes`` (already forgotten; delete them with :func:`remove_dir`).
    Leftover temp and trash directories and incomplete entries are deleted. Blocking."""
    root.mkdir(parents=True, exist_ok=True)
    found: list[tuple[float, str, int]] = []
    for child in root.iterdir():
        if child.name.startswith((_TEMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(child, ignore_errors=True)
        elif _DIGEST_NAME.fullmatch(child.name) and child.is_dir():
            size = entry_bytes(child)
            if size is None:
                shutil.rmtree(child, ignore_errors=True)
            else:
                found.append((child.stat().st_mtime, child.name, size))
    cache = DiskCache(root, capacity_bytes)
    over: list[Path] = []
    for _, digest, size in sorted(found):
        over += map(cache.path, cache.insert(digest, size, protect=()))
    return cache, over


def entry_bytes(path: Path) -> int | None:
    """The bytes of the adapter files in ``path``, or None when one is missing."""
    try:
        return sum((path / name).stat().st_size for name in ADAPTER_FILES)
    except FileNotFoundError:
        return None


def make_temp(root: Path) -> Path:
    """A fresh directory to download into, on the cache's file system (so the rename is atomic)."""
    return Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=root))


def commit(temp: Path, final: Path) -> int:
    """Rename the verified ``temp`` to ``final``; the entry's bytes. If ``final`` already exists
    it holds the same content (same digest), so ``temp`` is dropped instead."""
    try:
        temp.rename(final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(temp, ignore_errors=True)
    size = entry_bytes(final)
    if size is None:
        raise FileNotFoundError(f"cache entry {final} lost a file while it was committed")
    return size


def touch(path: Path) -> None:
    """Mark an entry used now, so that recency survives a restart."""
    os.utime(path)


def remove_dir(path: Path) -> None:
    """Take ``path`` out of its name atomically, then delete it; a missing path is fine."""
    trash = path.with_name(f"{_TRASH_PREFIX}{uuid.uuid4().hex}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    except OSError:  # cannot rename it (permissions): delete it where it is
        trash = path
    shutil.rmtree(trash, ignore_errors=True)

"""Weights files a read already checked against their digest, known again by what ``fstat`` says.

Every read of an adapter checks the bytes it uses against the version's content digest, so a file
changed after registration fails its own requests instead of serving other weights. The sha256 of
a 10 MB adapter costs ~9 ms of a core, a quarter of a load's CPU (bench/RESULTS.md, wt-replay).
It need not be paid twice for bytes that cannot have changed: a file's (device, inode, size,
mtime, ctime) moves with every write (the kernel sets ctime to the time of the write, and no call
sets it back), and replacing the file gives another inode. So the digest a read computed is kept
under that stamp, with the config's bytes (which every read reads whole), and a later read that
finds the same stamp before and after it reads is known to hold the same bytes.

Only where no one the server does not trust can write: the weights file must belong to the
server's own user or to root and be writable by neither its group nor others (POSIX ACLs shape
those group bits too). A tenant's file is hashed at every read, as before: a process that keeps
a file mapped shared and writable changes its bytes without moving ctime (tmpfs never moves it,
other file systems not until the page is written back), so a stamp proves nothing about a file
someone else may write. And only a stamp at least :data:`SETTLE_NS` old when its bytes were
hashed: a write within the file system's timestamp tick of the last one leaves ctime where it
was, so bytes hashed within a tick of a write could be followed by a write the stamp misses.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass

SETTLE_NS = 2_000_000_000  # coarser than any Linux file system's timestamp tick (FAT's mtime: 2 s)
MAX_ENTRIES = 65_536  # stamps remembered, least recently used forgotten first (~200 bytes each)


@dataclass(frozen=True)
class FileStamp:
    """What ``fstat`` said of a file, the same before and after a read of it, and when that read began."""

    identity: tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns
    uid: int
    mode: int
    read_ns: int  # time.time_ns() before the file was opened

    @staticmethod
    def of(before: os.stat_result, after: os.stat_result, read_ns: int) -> FileStamp | None:
        """The stamp of a read that saw ``before`` and ``after``; None when the file changed meanwhile."""
        stamp = FileStamp(_identity(before), before.st_uid, before.st_mode, read_ns)
        return stamp if _identity(after) == stamp.identity else None

    def others_cannot_write(self, euid: int) -> bool:
        """Only the server's user (``euid``) or root can write the file."""
        return stat.S_ISREG(self.mode) and self.uid in (euid, 0) and not self.mode & (stat.S_IWGRP | stat.S_IWOTH)

    def settled(self, settle_ns: int) -> bool:
        """The last write was ``settle_ns`` or more before the read began."""
        return self.identity[4] + settle_ns <= self.read_ns


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class VerifiedFiles:
    """(config bytes, weights stamp) -> the content digest a read of exactly those computed.

    Thread-safe (reads run on I/O threads). :meth:`remember` keeps only stamps of files others
    cannot write, settled when read; :meth:`digest_of` answers only for such a stamp.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES, settle_ns: int = SETTLE_NS, euid: int | None = None) -> None:
        self.max_entries, self.settle_ns = max_entries, settle_ns
        self.euid = os.geteuid() if euid is None else euid
        self._digests: OrderedDict[tuple[bytes, tuple[int, ...]], str] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # reads that skipped hashing (tests read it)

    def digest_of(self, config: bytes, stamp: FileStamp | None) -> str | None:
        """The digest remembered for these bytes of the config and this stamp of the weights, or None."""
        if stamp is None or not stamp.others_cannot_write(self.euid):
            return None
        key = _key(config, stamp)
        with self._lock:
            digest = self._digests.get(key)
            if digest is not None:
                self._digests.move_to_end(key)
                self.hits += 1
        return digest

    def remember(self, config: bytes, stamp: FileStamp | None, digest: str) -> None:
        """``digest`` was computed over ``config`` and the weights as read under ``stamp``."""
        if stamp is None or not stamp.others_cannot_write(self.euid) or not stamp.settled(self.settle_ns):
            return
        with self._lock:
            self._digests[_key(config, stamp)] = digest
            self._digests.move_to_end(_key(config, stamp))
            while len(self._digests) > self.max_entries:
                self._digests.popitem(last=False)


def _key(config: bytes, stamp: FileStamp) -> tuple[bytes, tuple[int, ...]]:
    return hashlib.sha256(config).digest(), stamp.identity

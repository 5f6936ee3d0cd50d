"""Opening adapter files that someone the server does not trust may have put there.

An adapter directory comes from a tenant's ``--adapter-root`` or from a download, so whatever
sits at a file's name is untrusted. A FIFO blocks the thread that opens it until a writer comes
(and one that reads it until data does), which no deadline gives back; a device never ends; a
sparse file of any size costs nothing to make and everything to read. So a file is opened at its
resolved path without following a link there (``O_NOFOLLOW``: the file checked is the file
opened), without waiting (``O_NONBLOCK``: a FIFO opens at once), must be a regular file
(``fstat``), and must fit the caller's cap before a byte of it is read.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class UntrustedFileError(OSError):
    """A file is not one the server reads: not a regular file, or over its size cap."""


def open_regular(path: Path, max_bytes: int | None = None) -> tuple[io.FileIO, int]:
    """``path`` open for reading (unbuffered) and its size in bytes; UntrustedFileError when it
    is not a regular file or is larger than ``max_bytes`` (None: no cap). Never blocks (a FIFO
    is refused, not waited on). Links on the way are followed once, to the real path, and that
    is what is opened."""
    real = os.path.realpath(path)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
            raise UntrustedFileError(f"{path.name} is {kind}, not a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise UntrustedFileError(f"{path.name} is {info.st_size} bytes, over the limit of {max_bytes}")
        os.set_blocking(fd, True)  # a regular file: reads behave as usual
        return io.FileIO(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The whole of a regular file of at most ``max_bytes`` (see :func:`open_regular`)."""
    f, size = open_regular(path, max_bytes)
    chunks, got = [], 0
    with f:
        while got <= size and (chunk := f.read(size + 1 - got)):  # one byte more: growth is refused
            chunks.append(chunk)
            got += len(chunk)
    data = b"".join(chunks)
    if len(data) != size:
        raise UntrustedFileError(f"{path.name} changed size while it was read ({size} bytes when opened)")
    return data

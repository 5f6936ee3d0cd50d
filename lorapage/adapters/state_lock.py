"""One writer per state directory: an exclusive lock on ``STATE_DIR/lock``, held for the life of
the engine (or fleet ingress) that keeps its registry there.

Two servers on one ``--state-dir`` (a rolling restart that starts the new one before the old one
stops) would each commit to the registry from a live view that does not see the other's, so an
id one registered could get the other's owner or content. The second one refuses to start
instead. The lock is ``flock``: the kernel drops it when its holder exits, ``kill -9`` included,
so a crash never leaves a stale lock behind. The file holds the holder's pid, for the message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "lock"


class StateDirError(RuntimeError):
    """The state directory cannot be had: another process holds it, or it cannot be locked.
    The message is one line that says what to do."""


class StateDirLock:
    """The exclusive lock on ``state_dir`` (made if missing), taken now or StateDirError."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StateDirError(f"--state-dir {state_dir}: cannot create {LOCK_FILE} ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise StateDirError(
                f"--state-dir {state_dir} is in use by another lorapage process{who}; each server needs a state "
                "dir of its own: stop that one first, or give this one another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def __del__(self) -> None:  # an engine that failed to start after taking it
        self.release()

    def release(self) -> None:
        """Give the directory up (idempotent)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

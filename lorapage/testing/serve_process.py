"""``lorapage serve`` as a child process: the one way tests and benchmarks start a real server.

:func:`start_serve` starts it on a free 127.0.0.1 port (``--port 0``) with its output in a log
file, and returns once it prints ``listening on http://...``; :meth:`ServeProcess.stop` stops it
as an operator would (SIGTERM: the graceful shutdown; SIGKILL if that takes too long).
:func:`run_serve` runs one that is expected to end by itself (a refused flag, a held state dir).
Standard library only, so a benchmark or a test imports it without the engine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"listening on (http://\S+)")


class ServeDidNotStart(RuntimeError):
    """The server exited, or did not print its URL in time; the message ends with its log's tail."""


def serve_command(*args: str) -> list[str]:
    """``lorapage serve --port 0 ARGS`` under this interpreter (a flag repeated in ``args`` wins)."""
    return [sys.executable, "-m", "lorapage.cli", "serve", "--port", "0", *args]


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}  # unbuffered: the URL line shows at once


@dataclass(frozen=True)
class ServeProcess:
    """A started server: its process, its base URL and the file its stdout and stderr go to.
    As a context manager it is stopped on exit (a no-op once it has exited)."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        """Everything the server has printed so far."""
        return self.log.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``: the exit status (0 after a graceful stop)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_serve(
    *args: str, under: Path, env: Mapping[str, str] | None = None, timeout_s: float = 180.0
) -> ServeProcess:
    """Start ``lorapage serve --port 0 ARGS`` in a fresh directory under ``under`` that holds its
    log (``serve.log``) and, unless ``args`` name another, its ``--state-dir`` (``state``), so no
    test or benchmark touches the user's registry. Raises :class:`ServeDidNotStart` with the log's
    tail if it exits, or prints no URL within ``timeout_s``."""
    home = Path(tempfile.mkdtemp(prefix="serve-", dir=under))
    log = home / "serve.log"
    with open(log, "wb") as out:  # the child holds its own descriptor to it
        cmd = serve_command("--state-dir", str(home / "state"), *args)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_environment(env))
    deadline = time.monotonic() + timeout_s
    while True:
        if found := READY.search(log.read_text(errors="replace")):
            return ServeProcess(proc, found.group(1), log)
        if proc.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    exited = proc.poll()
    if exited is None:
        proc.kill()
        proc.wait()
    why = f"printed no URL within {timeout_s:g} s" if exited is None else f"exited with {exited}"
    raise ServeDidNotStart(f"lorapage serve {why}; {log} ends:\n{log.read_text(errors='replace')[-3000:]}")


def run_serve(
    *args: str, env: Mapping[str, str] | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run ``lorapage serve --port 0 ARGS`` that should end by itself: its status, stdout and stderr."""
    return subprocess.run(
        serve_command(*args), capture_output=True, text=True, env=_environment(env), timeout=timeout_s
    )

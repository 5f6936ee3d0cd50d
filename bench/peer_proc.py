"""Engines in processes of their own, for the peer benchmarks: one JSON object a line each way.

A peer engine runs in a worker process (``llamacpp_peer.py`` under llama-cpp-python's interpreter,
``lorapage_peer.py`` under the project's), so no two engines ever share an OpenMP runtime, a thread
pool or an allocator. The bench holds a :class:`Worker` per process and asks it one request at a
time; the worker answers with :func:`serve`. Only the standard library here: the llama.cpp worker
runs in an interpreter that has neither lorapage nor torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

Request = dict[str, Any]


class WorkerFailed(RuntimeError):
    """A worker answered with an error, or exited."""


class Worker:
    """A worker process: ``argv`` started with its stderr in ``log``; :meth:`ask` sends one request
    and waits for its answer, :meth:`send` and :meth:`receive` let several workers run at once."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        self._log = log.open("w")
        self._proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )

    def send(self, **request: Any) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()

    def receive(self) -> Request:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise WorkerFailed(f"worker exited ({self._proc.wait()}); its log, {self.log}:\n{self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerFailed(f"worker failed: {reply['error']}\nits log, {self.log}:\n{self._tail()}")
        return reply

    def ask(self, **request: Any) -> Request:
        self.send(**request)
        return self.receive()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.send(op="quit")
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def _tail(self) -> str:
        self._log.flush()
        return self.log.read_text()[-3000:]


def serve(handle: Callable[[Request], Request]) -> None:
    """The worker's side: each line of stdin is a request (``op`` names it; ``quit`` ends the loop),
    answered by one line, ``handle``'s dict or ``{"error": ...}``. The answers go to the process's
    original stdout; anything else printing there (a C library included) goes to stderr instead."""
    out: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            reply = handle(request)
        except Exception as e:  # the bench shows it, with the worker's log
            reply = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
        out.write(json.dumps(reply) + "\n")

"""A CPU step's LoRA updates on a core the forward leaves free, each beside its base projection.

A decode step's LoRA update over many adapters is bound by memory: one step of the S-LoRA
replay's 2,000-adapter case (~24 distinct rank-16 adapters of the ~100M bench model) reads
250 MB of float32 pages, 15 ms at one thread, while the base's projections at 32 rows are bound
by arithmetic. Where the forward runs fewer intra-op threads than the machine has cores (that
replay's one on two), each projection's update runs on a thread of its own while the forward
thread runs the projection: into a zeroed delta, added to the projection's output once both are
done, which is PEFT's own order (``base(x) + B(A x) * scale``).

One thread, handed work through two ``SimpleQueue``s (C-implemented, a few microseconds a
hand-off): a step makes four hand-offs a layer.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from queue import SimpleQueue

import torch
from torch import Tensor

_STOP = None


class LoraSide:
    """One helper thread running a LoRA update at a time into a delta buffer it zeroes first.

    ``start`` hands it ``fn(delta)`` and returns the delta (a view of a buffer kept for the next
    update: add it before the next ``start``); ``finish`` waits for it. Errors in ``fn`` are
    raised by ``finish`` on the caller's thread.
    """

    def __init__(self) -> None:
        self._todo: SimpleQueue[tuple[Callable[[Tensor], None], Tensor] | None] = SimpleQueue()
        self._done: SimpleQueue[BaseException | None] = SimpleQueue()
        self._buffer = torch.empty(0)
        self._thread: threading.Thread | None = None
        self._busy = False
        self.updates = 0  # updates run here (tests and benches read it)

    def start(self, rows: int, cols: int, fn: Callable[[Tensor], None]) -> Tensor:
        """Run ``fn`` over a zeroed ``[rows, cols]`` float32 delta on the helper thread; the delta."""
        assert not self._busy, "one update at a time: finish the last one first"
        if self._buffer.numel() < rows * cols:
            self._buffer = torch.empty(rows * cols)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lorapage-lora-side", daemon=True)
            self._thread.start()
        delta = self._buffer[: rows * cols].view(rows, cols)
        self._busy = True
        self.updates += 1
        self._todo.put((fn, delta))
        return delta

    def finish(self) -> None:
        """Wait for the update :meth:`start` handed over; raise what it raised."""
        assert self._busy
        error = self._done.get()
        self._busy = False
        if error is not None:
            raise error

    def close(self) -> None:
        """End the helper thread (an update in flight finishes first)."""
        if self._thread is not None:
            self._todo.put(_STOP)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (job := self._todo.get()) is not _STOP:
            fn, delta = job
            try:
                # Zeroed by one C call here: a torch op on this thread would run its own OpenMP
                # team beside the forward's.
                ctypes.memset(delta.data_ptr(), 0, delta.numel() * delta.element_size())
                fn(delta)
                self._done.put(None)
            except BaseException as exc:  # handed to the forward thread, which raises it
                self._done.put(exc)

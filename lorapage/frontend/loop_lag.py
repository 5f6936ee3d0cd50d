"""How late the event loop wakes up: the delay every request on it inherits.

A task sleeps :attr:`LoopLagMonitor.interval_s` (50 ms) over and over and records how much later
than asked it woke. Whatever holds the loop (a tokenization on it, a blocking read) shows up as
lag. ``/metrics`` exports ``lorapage_event_loop_lag_seconds``, the worst lag of the last
``window_s`` seconds, ``lorapage_event_loop_lag_last_seconds``, the latest sample, and
``lorapage_event_loop_lag_samples_seconds``, every sample in a histogram (its percentiles over any
interval: the difference of two scrapes).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque

from lorapage.scheduler.metrics import Histogram

LAG_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLagMonitor:
    """Samples the loop's lag every ``interval_s``; keeps the samples of the last ``window_s``."""

    def __init__(self, interval_s: float = 0.05, window_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.last = 0.0
        # Samples are at least interval_s apart, so this many cover the window.
        self._samples: deque[tuple[float, float]] = deque(maxlen=math.ceil(window_s / interval_s) + 1)
        self.histogram = Histogram(LAG_BOUNDS_S)  # every sample, since the start
        self._task: asyncio.Task[None] | None = None

    def record(self, now: float, lag: float) -> None:
        self.last = lag
        self._samples.append((now, lag))
        self.histogram.observe(lag)

    def worst(self, now: float) -> float:
        """The largest lag sampled in the last ``window_s`` seconds (0 when none was)."""
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        return max((lag for _, lag in self._samples), default=0.0)

    async def _run(self) -> None:
        while True:
            asked = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self.record(now, max(0.0, now - asked))

    def start(self) -> None:
        """Start sampling on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lorapage-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

"""The driver: sends a trace's requests to a target and turns what came back into records.

Open loop (the default): request i is sent at ``start + arrival_s / speed`` whatever became of the
earlier ones, which is how independent users load a service (a closed loop would slow its own
offered load down whenever the server slows). ``concurrency=N`` is a closed loop instead: N
requests in flight, the next sent as soon as one ends, arrival times ignored.

Setting ``stop`` (Ctrl-C) ends the run early: nothing more is sent, requests in flight are cut
(``interrupted``, with what they had so far) and the rest are ``not_sent``, so every request of
the trace still has exactly one record. The clock is injected; everything else about time is
arithmetic on its readings.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lorapage.traces.records import CLIENT_ERROR, INTERRUPTED, NOT_SENT, OK, TIMEOUT, Record, Result, to_record
from lorapage.traces.trace import TraceRequest


class Target(Protocol):
    """Where requests go: a server over HTTP or an embedded engine."""

    metrics_note: str | None

    def describe(self) -> dict: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def send(self, req: TraceRequest, index: int, res: Result, clock: Callable[[], float]) -> None: ...

    async def counters(self) -> dict[str, float] | None: ...

    async def gauges(self) -> dict[str, float]: ...


class Progress(Protocol):
    """Told about every request sent and finished (a progress bar)."""

    def update(self, counts: Counter[str]) -> None: ...


@dataclass(frozen=True)
class RunOptions:
    speed: float = 1.0  # trace time / replay time
    concurrency: int | None = None  # closed loop with this many in flight; None: open loop
    timeout_s: float = 600.0  # per request
    probe_interval_s: float | None = 1.0  # server gauges (queue depth, running) this often; None: never


@dataclass
class RunResult:
    records: list[Record]  # one per trace request, in trace order
    duration_s: float  # from the start to the last record's end
    interrupted: bool
    counters_before: dict[str, float] | None
    counters_after: dict[str, float] | None
    samples: list[tuple[float, dict]] = field(default_factory=list)  # (run time, server gauges)
    metrics_note: str | None = None


class _Run:
    def __init__(self, trace: Sequence[TraceRequest], target: Target, opts: RunOptions, clock, stop, progress):
        self.trace, self.target, self.opts, self.clock = trace, target, opts, clock
        self.stop = stop
        self.progress = progress
        self.t0 = 0.0
        self.started: dict[int, tuple[float, float, Result]] = {}  # index -> (scheduled, sent, result)
        self.tasks: set[asyncio.Task] = set()
        self.counts: Counter[str] = Counter()
        self.samples: list[tuple[float, dict]] = []

    async def one(self, index: int, scheduled: float | None) -> None:
        """Send request ``index`` now (``scheduled``: when it was due; None, closed loop: now)."""
        res = Result()
        sent = self.clock()
        self.started[index] = (sent if scheduled is None else scheduled, sent, res)
        self.counts["sent"] += 1
        self._tell()
        try:
            async with asyncio.timeout(self.opts.timeout_s):
                await self.target.send(self.trace[index], index, res, self.clock)
        except TimeoutError:
            res.outcome, res.error = TIMEOUT, f"no complete answer within {self.opts.timeout_s:g}s"
        except asyncio.CancelledError:  # cut by stop: keep what it had
            res.outcome = INTERRUPTED
        except Exception as exc:  # a target bug must not lose the request's record
            res.outcome, res.error = CLIENT_ERROR, f"{type(exc).__name__}: {exc}"[:300]
        res.outcome = res.outcome or (OK if res.status == 200 else CLIENT_ERROR)
        if res.end is None:
            res.end = self.clock()
        self.counts["done"] += 1
        self.counts[res.outcome] += 1
        if res.status not in (0, 200):
            self.counts[str(res.status)] += 1
        self._tell()

    def _tell(self) -> None:
        if self.progress is not None:
            self.progress.update(self.counts)

    def track(self, task: asyncio.Task) -> asyncio.Task:
        """Keep ``task`` among those a stop cuts short, until it ends."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _wait_until(self, when: float) -> bool:
        """Sleep until ``when`` on the clock; False when stopped meanwhile."""
        delay = when - self.clock()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)
        return not self.stop.is_set()

    async def open_loop(self, order: list[int]) -> None:
        for i in order:
            due = self.t0 + self.trace[i].arrival_s / self.opts.speed
            if not await self._wait_until(due):
                return
            self.track(asyncio.create_task(self.one(i, due)))

    async def closed_loop(self, order: list[int], n: int) -> None:
        queue = iter(order)

        async def worker() -> None:
            for i in queue:
                if self.stop.is_set():
                    return
                await self.one(i, None)

        await asyncio.wait([self.track(asyncio.create_task(worker())) for _ in range(n)])

    async def probe(self) -> None:
        interval = self.opts.probe_interval_s
        assert interval is not None
        while True:
            try:
                gauges = await self.target.gauges()
            except Exception:  # a scrape that fails ends probing, never the run
                return
            if gauges:
                self.samples.append((round(self.clock() - self.t0, 3), gauges))
            await asyncio.sleep(interval)

    async def run(self) -> RunResult:
        order = sorted(range(len(self.trace)), key=lambda i: self.trace[i].arrival_s)
        before = await self.target.counters()
        self.t0 = self.clock()
        prober = asyncio.create_task(self.probe()) if self.opts.probe_interval_s else None
        if self.opts.concurrency:
            dispatch = asyncio.create_task(self.closed_loop(order, self.opts.concurrency))
        else:
            dispatch = asyncio.create_task(self.open_loop(order))
        stopped = asyncio.create_task(self.stop.wait())
        await asyncio.wait({dispatch, stopped}, return_when=asyncio.FIRST_COMPLETED)
        while self.tasks and not self.stop.is_set():  # open loop: dispatched, now let them finish
            await asyncio.wait({*self.tasks, stopped}, return_when=asyncio.FIRST_COMPLETED)
        interrupted = self.stop.is_set()
        for task in (dispatch, *self.tasks):
            task.cancel()
        await asyncio.gather(dispatch, *self.tasks, return_exceptions=True)
        stopped.cancel()
        if prober is not None:
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
        after = await self.target.counters()
        records = self._records()
        return RunResult(
            records,
            max((r.end_s or 0.0 for r in records), default=0.0),
            interrupted,
            before,
            after,
            self.samples,
            self.target.metrics_note,
        )

    def _records(self) -> list[Record]:
        out = []
        for i, req in enumerate(self.trace):
            if i in self.started:
                scheduled, sent, res = self.started[i]
            else:
                scheduled, sent = self.t0 + req.arrival_s / self.opts.speed, None
                res = Result(outcome=NOT_SENT)
            out.append(to_record(i, req.tenant, req.model, req.max_tokens, scheduled, sent, res, self.t0))
        return out


async def replay(
    trace: Sequence[TraceRequest],
    target: Target,
    opts: RunOptions | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    stop: asyncio.Event | None = None,
    progress: Progress | None = None,
) -> RunResult:
    """Replay ``trace`` against ``target`` (started and closed by the caller)."""
    opts = opts or RunOptions()
    if opts.speed <= 0:
        raise ValueError(f"speed must be > 0; got {opts.speed}")
    if opts.concurrency is not None and opts.concurrency < 1:
        raise ValueError(f"concurrency must be >= 1; got {opts.concurrency}")
    for i, req in enumerate(trace):
        try:
            req.check()
        except ValueError as exc:
            raise ValueError(f"trace request {i}: {exc}") from None
    return await _Run(trace, target, opts, clock, stop or asyncio.Event(), progress).run()

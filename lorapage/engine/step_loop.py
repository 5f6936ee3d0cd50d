"""The step loop: a task on the engine's event loop that plans a step, runs it on the single
forward thread, and applies its results, for as long as there is work."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from lorapage.engine.step_planner import StepPlanner
from lorapage.errors import EngineStepError
from lorapage.model.runner import ModelRunner, StepPlan
from lorapage.omp_env import release_thread_team

log = logging.getLogger("lorapage.engine")


class Wakeup:
    """Wakes the step loop when there is work. Made before the loop and the parts that ring it (an
    adapter cache whose load is done), and handed to both."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def renew(self) -> asyncio.Event:
        """A fresh event, for a loop starting on a new event loop."""
        self._event = asyncio.Event()
        return self._event

    def __call__(self) -> None:
        if self._event is not None:
            self._event.set()


class StepLoop:
    """Runs steps while there is work and sleeps until :meth:`wake` otherwise."""

    def __init__(
        self,
        planner: StepPlanner,
        runner: ModelRunner,
        forward: Executor,
        wakeup: Wakeup | None = None,
        *,
        on_new_loop: Callable[[], None],
        on_prefill: Callable[[float, int], None] | None = None,
    ) -> None:
        self.planner, self.runner, self.forward = planner, runner, forward
        self._wakeup = wakeup if wakeup is not None else Wakeup()
        self._on_new_loop = on_new_loop  # state tied to the old loop (adapter loads) must reset
        # Told (seconds, tokens) of each step that prefilled: what recomputing a cached block costs.
        self._on_prefill = on_prefill
        self._loop: asyncio.AbstractEventLoop | None = None
        self.busy_s = 0.0  # time steps took, in all (the device time usage is apportioned from)
        self._task: asyncio.Task | None = None

    def bind(self) -> None:
        """Run on the current event loop (re-binding when a previous loop ended)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not None and self._loop is not loop and not self._loop.is_closed() and self.planner.requests:
            raise RuntimeError("this engine has requests in flight on another event loop")
        self._loop = loop
        wake = self._wakeup.renew()
        self._on_new_loop()
        self._task = loop.create_task(self._run(wake), name="lorapage-step-loop")

    def wake(self) -> None:
        self._wakeup()

    async def stop(self) -> None:
        """Cancel the loop; a step in flight finishes on the forward thread, unapplied."""
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _run(self, wake: asyncio.Event) -> None:
        try:
            await self._steps(wake)
        finally:
            # The loop ends (its event loop closing: ``generate_batch``'s ``asyncio.run`` returning,
            # or stop()) without passing the idle branch below: its team goes too. Two engines
            # in one process, each used through generate_batch in turn, otherwise kept both
            # teams and every region of either waited on a throttled worker (2-thread steps at
            # 0.6-0.7x; bench/RESULTS.md, 2026-12-07 session 7).
            try:
                self.forward.submit(release_thread_team)
            except RuntimeError:  # the forward thread is shut down already: no team is left
                pass

    async def _steps(self, wake: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await wake.wait()
            wake.clear()
            try:
                while True:
                    plan = self.planner.plan_step()
                    if plan is None:
                        # Idle: the forward's OpenMP workers end, so another engine's forward in
                        # this process (a second precision, a dedicated tier) has the only team
                        # while this one waits, and libgomp does not throttle its spin (omp_env).
                        await loop.run_in_executor(self.forward, release_thread_team)
                        break
                    started = time.perf_counter()
                    sampled = await loop.run_in_executor(self.forward, _execute, self.runner, plan)
                    seconds = time.perf_counter() - started
                    self.busy_s += seconds
                    if self._on_prefill is not None and len(plan.input_ids) > plan.num_decode:
                        self._on_prefill(seconds, len(plan.input_ids))
                    if plan.steps > 1:
                        self.planner.apply_window(plan, sampled, seconds)
                    else:
                        self.planner.apply(plan, sampled, seconds)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never leave callers hanging on a dead loop
                log.exception("engine step failed; failing the requests in flight")
                # One that says what failed (a lost tensor-parallel rank) is passed on as it is.
                error = exc if isinstance(exc, EngineStepError) else EngineStepError(f"the engine step failed: {exc}")
                self.planner.fail_all(error)


def _execute(runner: ModelRunner, plan: StepPlan) -> Any:
    """``runner.execute(plan)`` on the forward thread. A StopIteration escaping it (a ``next()``
    that ran dry) cannot be set on an asyncio future: the step would never end and every request
    would hang. It is raised as the RuntimeError it is, so the step fails like any other."""
    try:
        return runner.execute_window(plan) if plan.steps > 1 else runner.execute(plan)
    except StopIteration as exc:
        raise RuntimeError(f"StopIteration escaped the forward pass: {exc!r}") from exc

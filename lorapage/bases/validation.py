"""A base upgrade's validation job: every adapter's drift check, running base vs a candidate base.

``POST /v1/bases/{digest}/validate`` starts one (:class:`BaseValidator`, one at a time per process:
a second is refused with 409 while one runs). The job loads the candidate base from its directory
(checked to have ``digest``) as a second :class:`~lorapage.engine.Engine` in this process, built
in a worker thread and closed at the end, registers each adapter on it as trained on it (the one
place an adapter meets a base it was not trained on), and runs the adapter's stored check prompts
on both engines (:func:`lorapage.bases.check.prompt_drifts`: greedy on the running base, then free
and teacher-forced on the new one). The running engine serves its traffic meanwhile; the check's
requests are its own (tenant ``default``) and count as the adapter's traffic. When this process
already serves the candidate base (``lorapage serve --base``), the job checks on that engine
instead, each version registered there under an id of the job's own and removed after its check.
A fleet runs the same job at its ingress with a checker of its own (:class:`Checker`;
:mod:`lorapage.fleet.upgrades`): the check's two halves on its two bases' deployments.

Each adapter version gets a migration state toward ``digest``, stored in the registry
(:mod:`lorapage.registry.drift_state`): ``opted-out`` when its owner opted out (not checked),
``pending`` while it waits or runs, and when it has no check prompts (stays pending: nothing
moves unchecked), ``passed`` / ``failed`` by :func:`lorapage.bases.drift.verdict`'s thresholds,
with the numbers and the customer notice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from lorapage.adapters.binding import shown_digest
from lorapage.bases.drift import DriftThresholds, PromptDrift, verdict
from lorapage.errors import ConflictError, InvalidRequestError, LorapageError
from lorapage.registry.drift_state import FAILED, MIGRATED, OPTED_OUT, PASSED, PENDING, DriftRecord, MigrationRow

log = logging.getLogger("lorapage.bases")

MAX_TOKENS = 32  # greedy tokens compared per prompt
CANDIDATE_SEQS = 16  # sequences the candidate engine runs at once
KEPT_JOBS = 16  # finished jobs remembered (in memory; the states themselves are in the registry)
NO_PROMPTS = "no check prompts stored: PUT /v1/adapters/{id}/check_prompts, then validate again"


@dataclass
class ValidationJob:
    """One validation toward base ``target`` (a stored digest), as ``GET .../validate`` shows it."""

    id: str
    target: str
    model: str  # the candidate base's directory
    started: float
    adapters: list[str]  # the version keys checked (id@N on the running base)
    status: str = "running"  # running | done | error
    error: str | None = None  # why the job could not run (status error)
    checked: int = 0  # adapters whose check has ended
    finished: float | None = None
    states: dict[str, str] = field(default_factory=dict)  # version key -> state, as the job recorded it


class BaseValidator:
    """Runs at most one validation job at a time and remembers the last few."""

    def __init__(self, limits: DriftThresholds | None = None, max_tokens: int = MAX_TOKENS) -> None:
        self.limits, self.max_tokens = limits or DriftThresholds(), max_tokens
        self.jobs: dict[str, ValidationJob] = {}  # job id -> job, oldest first, bounded
        self._running: asyncio.Task | None = None

    def latest(self, target: str) -> ValidationJob | None:
        """The newest job toward ``target``."""
        return next((j for j in reversed(self.jobs.values()) if j.target == target), None)

    def start(
        self, engine, target: str, model: str, adapters: Sequence[str] | None = None, *, running=None
    ) -> ValidationJob:
        """Start a job checking ``adapters`` (ids; None: every id whose current version is on the
        running base) toward ``target``. ConflictError while another runs; InvalidRequestError
        for a target that is the running base, or an id not served here. ``running``: an engine
        this process already runs on ``target`` (``lorapage serve --base``), checked on instead
        of a candidate loaded from ``model``."""
        self._check_free(engine.digest, target)
        keys = current_versions(engine, adapters)

        async def checker(job: ValidationJob) -> Checker:
            if running is not None:
                return EngineChecker(engine, running, borrowed=True)
            loop = asyncio.get_running_loop()
            return EngineChecker(engine, await loop.run_in_executor(None, candidate_engine, engine, model, target))

        async def precheck(job: ValidationJob) -> None:
            if running is None:  # before any state is written: a wrong directory leaves the last check's states
                await asyncio.get_running_loop().run_in_executor(None, check_digest, model, target)

        return self.start_with(engine.admin.catalog.drift_record, engine.digest, target, model, keys, checker, precheck)

    def start_with(
        self,
        registry: DriftRecord,
        running_digest: str,
        target: str,
        model: str,
        keys: list[str],
        checker: Callable[[ValidationJob], Awaitable[Checker]],
        precheck: Callable[[ValidationJob], Awaitable[None]] | None = None,
    ) -> ValidationJob:
        """Start a job checking version ``keys`` (on base ``running_digest``) toward ``target``,
        states in ``registry``, each version's drifts from the :class:`Checker` ``checker`` makes
        once there is a version to check (a fleet's: its two bases' deployments)."""
        self._check_free(running_digest, target)
        job = ValidationJob(uuid.uuid4().hex[:16], target, model, time.time(), keys)
        self.jobs[job.id] = job
        while len(self.jobs) > KEPT_JOBS:
            del self.jobs[next(iter(self.jobs))]
        run = self._run(registry, running_digest, job, checker, precheck)
        self._running = asyncio.get_running_loop().create_task(run)
        return job

    def _check_free(self, running_digest: str, target: str) -> None:
        if self._running is not None and not self._running.done():
            # The last job started is the one the task runs; its status may already say done
            # while the task finishes its last writes, so it is not looked up by status.
            running = next(reversed(self.jobs.values()))
            raise ConflictError(
                f"validation {running.id} (toward {shown_digest(running.target)}) is still running; one runs at a "
                "time: poll GET /v1/bases/{digest}/validate and start this one when it is done"
            )
        if target == running_digest:
            raise InvalidRequestError(f"{shown_digest(target)} is the running base; name the new base's digest")

    async def cancel(self) -> None:
        """Stop the running job (the server is closing); its candidate engine is closed."""
        task, self._running = self._running, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(
        self,
        registry: DriftRecord,
        running_digest: str,
        job: ValidationJob,
        make_checker: Callable[[ValidationJob], Awaitable[Checker]],
        precheck: Callable[[ValidationJob], Awaitable[None]] | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        checker: Checker | None = None
        todo: list[tuple[str, tuple[str, ...]]] = []
        try:
            if precheck is not None:
                await precheck(job)
            plan = await loop.run_in_executor(None, self._plan, registry, job)
            todo = [(key, prompts) for key, prompts in plan if prompts]
            if todo:
                checker = await make_checker(job)
            for key, prompts in todo:
                assert checker is not None
                row = await self._check(checker, running_digest, job, key, prompts)
                job.states[key] = row.state
                job.checked += 1
                await loop.run_in_executor(None, registry.set_migration_states, [row])
            job.status = "done"
        except LorapageError as exc:
            job.status, job.error = "error", exc.message
        except Exception as exc:  # a base that cannot be loaded, a device fault: the job's, not the server's
            log.exception("validation %s toward %s failed", job.id, shown_digest(job.target))
            job.status, job.error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            if checker is not None:
                await checker.close()
            stuck = [key for key, _ in todo if job.states.get(key) == PENDING]
            if job.status == "error" and stuck:  # the checks that never ran say why
                reason = f"validation stopped: {job.error}"
                rows = [
                    MigrationRow(*parse_key(k), job.target, PENDING, reason, None, None, job.id, None, 0.0)
                    for k in stuck
                ]
                await loop.run_in_executor(None, registry.set_migration_states, rows)
            job.finished = time.time()

    def _plan(self, registry: DriftRecord, job: ValidationJob) -> list[tuple[str, tuple[str, ...]]]:
        """Each version's prompts (in a worker: the registry is read), its first state recorded. A
        version migrated toward the target already stays so (not checked again)."""
        plan: list[tuple[str, tuple[str, ...]]] = []
        rows = []
        done = {r.key for r in registry.migration_states(job.target) if r.state == MIGRATED}
        for key in job.adapters:
            adapter_id, version = parse_key(key)
            if key in done:
                job.states[key] = MIGRATED
                continue
            settings = registry.check_prompts(adapter_id)
            prompts: tuple[str, ...]
            if settings.opt_out:
                state, reason, prompts = OPTED_OUT, "the owner opted out of base migrations", ()
            elif not settings.all_prompts():
                state, reason, prompts = PENDING, NO_PROMPTS.replace("{id}", adapter_id), ()
            else:
                state, reason, prompts = PENDING, "queued for its drift check", settings.all_prompts()
            rows.append(MigrationRow(adapter_id, version, job.target, state, reason, None, None, job.id, None, 0.0))
            job.states[key] = state
            plan.append((key, prompts))
        registry.set_migration_states(rows)
        return plan

    async def _check(
        self, checker: Checker, running_digest: str, job: ValidationJob, key: str, prompts: tuple[str, ...]
    ) -> MigrationRow:
        """One adapter version's drift check and its state (a check that cannot run stays pending)."""
        adapter_id, version = parse_key(key)
        base = MigrationRow(adapter_id, version, job.target, PENDING, None, None, None, job.id, None, 0.0)
        try:
            drifts = await checker.drifts(job, key, prompts, self.max_tokens)
        except LorapageError as exc:
            return dataclasses.replace(base, reason=f"the check could not run: {exc.message}")
        report = verdict(drifts, self.limits)
        return dataclasses.replace(
            base,
            state=PASSED if report.passed else FAILED,
            reason="; ".join(report.reasons) or None,
            numbers=asdict(report),
            notice=report.notice(adapter_id, shown_digest(running_digest), shown_digest(job.target)),
        )


class Checker(Protocol):
    """Runs one adapter version's drift check toward a job's base: greedy on the running base,
    free and teacher-forced on the new one (:mod:`lorapage.bases.check`)."""

    async def drifts(
        self, job: ValidationJob, key: str, prompts: tuple[str, ...], max_tokens: int
    ) -> list[PromptDrift]:
        """``key``'s drift on each of ``prompts`` (a LorapageError when the check cannot run)."""
        ...

    async def close(self) -> None:
        """The job is over."""
        ...


class EngineChecker:
    """The check on two engines in this process: the running one and ``new`` (a candidate this
    checker closes; ``borrowed``: an engine serving the new base's traffic, on which each version
    is registered under an id of the job's own and removed after its check)."""

    def __init__(self, engine, new, *, borrowed: bool = False) -> None:
        self.engine, self.new, self.borrowed = engine, new, borrowed

    async def drifts(
        self, job: ValidationJob, key: str, prompts: tuple[str, ...], max_tokens: int
    ) -> list[PromptDrift]:
        from lorapage.bases.check import prompt_drifts

        adapter_id, _ = parse_key(key)
        name = check_name(job, adapter_id) if self.borrowed else adapter_id
        new = self.new
        try:
            async with self.engine.admin.catalog.version_files(key) as path:
                # Read and checked in a worker, committed on the loop (the new base's own catalog);
                # bound to the new base, whose digest the job checked already (or its engine has).
                await new.admin.catalog.register_checked(name, path, expected_base_digest=job.target)
            return await prompt_drifts(self.engine, new, key, name, prompts, max_tokens=max_tokens)
        finally:
            if self.borrowed:
                drop_check_version(new, name)

    async def close(self) -> None:
        if not self.borrowed:
            await self.new.close()


def check_name(job: ValidationJob, adapter_id: str) -> str:
    """The id a version is checked under on an engine that serves the new base's traffic."""
    return f"check-{job.id}-{adapter_id}"


def drop_check_version(engine, name: str) -> None:
    """Remove a version registered for a check from an engine serving traffic (left to it, logged,
    when still running: the job was cancelled mid-check)."""
    if name in engine.admin.catalog.index.ids():
        try:
            engine.admin.catalog.remove(name)
        except LorapageError as exc:
            log.warning("a validation left %s registered on the new base: %s", name, exc.message)


def parse_key(key: str) -> tuple[str, int]:
    adapter_id, _, number = key.rpartition("@")
    return adapter_id, int(number)


def current_versions(engine, adapters: Sequence[str] | None) -> list[str]:
    """The version keys to check: each id's current version, where it is served on this base."""
    ids = list(adapters) if adapters is not None else engine.admin.catalog.index.ids()
    keys = []
    for adapter_id in ids:
        current = [v for v in engine.admin.catalog.versions(adapter_id) if v.current]
        if not current or (not current[0].servable and adapters is not None):
            raise InvalidRequestError(
                f"adapter {adapter_id!r} has no current version served on this base", param="adapters"
            )
        if current[0].servable:
            keys.append(current[0].key)
    return keys


def check_digest(model: str, target: str) -> None:
    """InvalidRequestError unless the base in ``model`` has digest ``target`` (its weights are hashed)."""
    from lorapage.model.loader import model_digest

    found = model_digest(model)
    if found != target:
        raise InvalidRequestError(
            f"{model} holds base {shown_digest(found)}, not {shown_digest(target)} named in the route", param="model"
        )


def candidate_engine(engine, model: str, target: str):
    """The candidate base (checked to be ``target`` already) as a second engine, built in a
    worker thread: its weights are read."""
    from lorapage.engine import Engine

    config = dataclasses.replace(
        engine.config,
        model=model,
        state_dir=None,  # its registry is in memory: the running server's is the one record
        adapter_cache_dir=None,
        shared_envelope="",  # the check compares outputs; what the shared pool serves is not its question
        shared_max_cost_pct=None,
        base_names=None,
        enable_prefix_caching=False,
        # Small and short-lived: one adapter at a time, a few sequences, no CUDA graphs, its pool
        # sized for that alone from the device memory the running engine left (it already holds
        # its share of gpu_memory_utilization: a GPU needs room for both bases).
        max_loras=1,
        max_resident_loras=None,
        max_num_seqs=min(engine.config.max_num_seqs, CANDIDATE_SEQS),
        max_num_batched_tokens=None,
        reserved_tail_lanes=None,
        num_pages=None,
        gpu_memory_utilization=1.0,
        enforce_eager=True,
    )
    return Engine(config)


def check_model_dir(model: str) -> str:
    """The candidate base's directory as given in the body: absolute, a directory with a
    ``config.json`` (400 otherwise)."""
    path = Path(model)
    if not path.is_absolute():
        raise InvalidRequestError(f"model must be an absolute directory path; got {model[:200]!r}", param="model")
    if not (path / "config.json").is_file():
        raise InvalidRequestError(
            f"{model[:200]} is not a model directory (no config.json there, or it cannot be read)", param="model"
        )
    return str(path)

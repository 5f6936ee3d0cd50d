"""The fleet's dedicated tier: one Ray Serve application per promoted adapter, started at runtime.

A Serve application is a static graph, so a dedicated deployment is an application of its own,
started by the ingress when an adapter is promoted: ``serve.run`` (through
:func:`~lorapage.fleet.start.run_app`, in a worker thread, under ``start_timeout_s``) of one
:class:`~lorapage.fleet.merged.MergedReplica` deployment, named ``lorapage-merged-<id>``, with no
HTTP route (only the ingress calls it, through the handle ``serve.run`` returns). Every replica
merges the version into its base weights and runs the equivalence check in its constructor; the
ingress reads the verdict and only then routes the version's requests there
(:meth:`DedicatedDeployments.route`). A failed check (or a deployment Ray could not place in
time) takes the application down again and leaves the adapter on the shared pool, its state
``failed`` with the reason. Demotion routes the adapter back to the shared pool first, then
deletes the application (Ray lets requests in flight end, within its graceful-shutdown timeout).

The state lives in the ingress (it is what routes); each promotion and demotion is audited in
the fleet's registry (actions ``promote`` and ``demote``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from ray import serve
from ray.exceptions import RayActorError

from lorapage.adapters.names import parse_name
from lorapage.engine.merge_check import CHECK_PROMPTS
from lorapage.errors import AdapterNotFoundError, ConflictError, ServiceUnavailableError
from lorapage.fleet.config import MERGED_APP_PREFIX, FleetConfig
from lorapage.fleet.merged import MergedReplica, MergedStatus
from lorapage.fleet.messages import EngineProfile, IdState
from lorapage.fleet.registry import FleetRegistry
from lorapage.fleet.start import run_app
from lorapage.frontend.responses import PromotionOut
from lorapage.usage.ledger import Key, Usage

log = logging.getLogger("lorapage.fleet")

T = TypeVar("T")
MERGED_DEPLOYMENT = "MergedReplica"
_STATUS_TIMEOUT_S = 30.0  # for a running replica's verdict (it was computed in its constructor)
State = Literal["starting", "merged", "failed", "stopping"]


@dataclass
class Promotion:
    """One adapter's dedicated deployment (or the failure of its start)."""

    adapter_id: str
    key: str  # id@N: the version merged
    state: State
    actor: str
    since: float
    handle: Any = None  # the application's DeploymentHandle, once it serves
    statuses: tuple[MergedStatus, ...] = ()
    reason: str | None = None

    @property
    def app(self) -> str:
        return MERGED_APP_PREFIX + self.adapter_id

    def out(self) -> PromotionOut:
        check = self.statuses[0].check if self.statuses else None
        return PromotionOut(
            state=self.state,
            version=int(parse_name(self.key)[1] or 0),
            deployment=self.app,
            since=int(self.since),
            actor=self.actor,
            replicas=sorted({s.replica_id for s in self.statuses}),
            check=check,
            reason=self.reason,
        )


class DedicatedDeployments:
    """The promoted adapters, their applications, and which requests go to them."""

    def __init__(
        self, config: FleetConfig, registry: FleetRegistry, primary: Callable[[], Awaitable[EngineProfile]]
    ) -> None:
        self.config, self.registry = config, registry
        self._primary = primary  # the primary base's engines' profile: the base a merged deployment runs
        self._by_id: dict[str, Promotion] = {}
        self._tasks: set[asyncio.Task] = set()  # starts under way (held so they are not collected)
        self._adopting: asyncio.Task | None = None

    # -- routing ----------------------------------------------------------------------------------

    def route(self, key: str | None) -> Any | None:
        """The handle of the dedicated deployment serving version ``key`` (id@N), or None: the
        shared pool serves it (its id is not promoted, or another version of it is)."""
        if key is None:
            return None
        promotion = self._by_id.get(parse_name(key)[0])
        if promotion is None or promotion.state != "merged" or promotion.key != key:
            return None
        return promotion.handle

    async def usage_parts(self, since_hour: int | None) -> list[list[tuple[Key, Usage]]]:
        """Every serving dedicated replica's usage ledger, one part each (``GET /v1/usage`` adds
        them to the engine replicas'). 503 when a replica does not answer in time. A demoted
        deployment's usage leaves with it, as a replaced engine replica's does."""
        parts: list[list[tuple[Key, Usage]]] = []
        for promotion in [p for p in self._by_id.values() if p.state == "merged" and p.handle is not None]:

            async def rows(handle: Any = promotion.handle) -> tuple[str, list[tuple[Key, Usage]]]:
                return await asyncio.wait_for(handle.usage_rows.remote(since_hour), _STATUS_TIMEOUT_S)

            try:
                seen = await self._each_replica(rows)
            except (TimeoutError, RayActorError):
                seen = {}
            if len(seen) < self.config.dedicated.replicas:
                raise ServiceUnavailableError(
                    f"the dedicated deployment of {promotion.key} did not report its usage; retry", retry_after=5
                )
            parts += seen.values()
        return parts

    async def _each_replica(self, ask: Callable[[], Awaitable[tuple[str, T]]]) -> dict[str, T]:
        """Replica id -> answer, asked through a deployment handle until as many replicas as a
        deployment runs have answered (Ray routes each call to one of them; one Ray replaced since
        has a new id), at most 20 calls a replica."""
        wanted = self.config.dedicated.replicas
        seen: dict[str, T] = {}
        for _ in range(20 * wanted):
            replica_id, answer = await ask()
            seen[replica_id] = answer
            if len(seen) >= wanted:
                break
        return seen

    @property
    def promotions(self) -> Mapping[str, Promotion]:
        """Every adapter id with a dedicated deployment (or a failed start), and its state (read only)."""
        return MappingProxyType(self._by_id)

    def ids(self, *states: State) -> set[str]:
        """The adapter ids whose deployment is in one of ``states``."""
        return {i for i, p in self._by_id.items() if p.state in states}

    # -- an ingress restart -----------------------------------------------------------------------

    def ensure_adopted(self) -> None:
        """Start :meth:`adopt` once (the ingress calls it at every heartbeat; the first one adopts)."""
        if self._adopting is None:
            self._adopting = task = asyncio.get_running_loop().create_task(self.adopt())
            task.add_done_callback(self._adopted)

    def _adopted(self, task: asyncio.Task) -> None:
        """An adoption that failed (Ray did not answer) is tried again at the next heartbeat."""
        if not task.cancelled() and task.exception() is not None:
            log.warning("adopting the running dedicated deployments failed; retrying: %s", task.exception())
            self._adopting = None

    async def adopt(self) -> None:
        """Take over the dedicated deployments a previous ingress started: each running
        ``lorapage-merged-<id>`` application whose replicas all passed their check, on a version of
        that id still registered, serves again (state ``merged``, actor ``adopted``); any other is
        deleted. Until then the shared pool serves those adapters."""
        apps = await asyncio.to_thread(lambda: dict(serve.status().applications))
        for name, overview in apps.items():
            adapter_id = name.removeprefix(MERGED_APP_PREFIX)
            if not name.startswith(MERGED_APP_PREFIX) or adapter_id in self._by_id:
                continue
            statuses: tuple[MergedStatus, ...] = ()
            handle: Any = None
            if str(getattr(overview.status, "value", overview.status)) == "RUNNING":
                try:
                    handle = await asyncio.to_thread(serve.get_app_handle, name)
                    statuses = await asyncio.wait_for(self._statuses(handle), _STATUS_TIMEOUT_S)
                except Exception as exc:  # gone meanwhile, or not answering: deleted below
                    log.warning("dedicated deployment %s did not report: %s", name, exc)
            key = statuses[0].adapter if statuses else ""
            if (
                statuses
                and all(s.passed and s.adapter == key for s in statuses)
                and parse_name(key)[0] == adapter_id
                and self.registry.index.row(key) is not None
                and adapter_id not in self._by_id  # promoted meanwhile
            ):
                self._by_id[adapter_id] = Promotion(adapter_id, key, "merged", "adopted", time.time(), handle, statuses)
                log.info("adapter %s is served by its dedicated deployment %s (adopted)", key, name)
            elif adapter_id not in self._by_id:
                log.warning("deleting dedicated deployment %s: no version it serves is registered and checked", name)
                await asyncio.to_thread(_delete, name)

    # -- promotion --------------------------------------------------------------------------------

    def promote(self, key: str, actor: str) -> Promotion:
        """Start the dedicated deployment of version ``key``: answered at once (state
        ``starting``); the deployment serves once every replica's check passed. 409 when the id
        has one already (or one starting or stopping)."""
        adapter_id, _ = parse_name(key)
        held = self._by_id.get(adapter_id)
        if held is not None and held.state != "failed":
            raise ConflictError(
                f"adapter {adapter_id!r} already has a dedicated deployment ({held.state}, version {held.key}); "
                f"demote it first (POST /v1/adapters/{adapter_id}/demote)",
                param="id",
            )
        row = self.registry.index.row(key)
        if row is None:
            raise AdapterNotFoundError(f"adapter {key!r} does not exist", param="id")
        promotion = Promotion(adapter_id, key, "starting", actor, time.time())
        self._by_id[adapter_id] = promotion
        state = IdState(adapter_id, self.registry.index.owner(adapter_id), row.version, (row,))
        task = asyncio.get_running_loop().create_task(self._start(promotion, state))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return promotion

    def _prompts(self, adapter_id: str) -> tuple[str, ...]:
        """The check's prompts: the built-in ones and the id's stored check prompts (bounded)."""
        stored = self.registry.drift_record.check_prompts(adapter_id).all_prompts()
        return CHECK_PROMPTS + stored[: self.config.dedicated.check_prompts]

    async def _start(self, promotion: Promotion, state: IdState) -> None:
        """Run the application, read every replica's verdict, then serve or take it down."""
        dedicated = self.config.dedicated
        (row,) = state.versions
        primary = (await self._primary()).base_digest
        if row.base_digest != primary:  # --base: a side base's version would be merged into the wrong base
            await self._finish(
                promotion, f"trained on base {row.base_digest}; dedicated deployments run the primary base {primary}"
            )
            return
        app = serve.deployment(
            name=MERGED_DEPLOYMENT,
            num_replicas=dedicated.replicas,
            max_ongoing_requests=self.config.max_ongoing_requests,
            ray_actor_options={"num_cpus": self.config.replica_cpus, "num_gpus": self.config.replica_gpus},
        )(MergedReplica).bind(
            self.config.engine, self.config.roots(), state, await asyncio.to_thread(self._prompts, promotion.adapter_id)
        )
        needs = {MERGED_DEPLOYMENT: {"CPU": self.config.replica_cpus, "GPU": self.config.replica_gpus}}
        try:
            handle = await asyncio.to_thread(
                run_app, app, needs, dedicated.start_timeout_s, name=promotion.app,
                timeout_flag="--dedicated-start-timeout",
            )  # fmt: skip
            promotion.statuses = await self._statuses(handle)
        except Exception as exc:  # StartError (Ray could not place or start it), or Ray's own: the pool keeps it
            log.warning("the dedicated deployment of %s did not start: %s", promotion.key, exc)
            await self._finish(promotion, f"the deployment did not start: {exc}")
            return
        failed = next((s for s in promotion.statuses if not s.passed), None)
        if failed is not None or len(promotion.statuses) < dedicated.replicas:
            reported = f"only {len(promotion.statuses)} of {dedicated.replicas} replicas reported their check"
            reason = failed.reason() if failed else reported
            await self._finish(promotion, reason)
            return
        promotion.handle, promotion.state, promotion.since = handle, "merged", time.time()
        log.info("adapter %s is served by its dedicated deployment %s", promotion.key, promotion.app)
        await self._audit("promote", promotion, "ok")

    async def _statuses(self, handle: Any) -> tuple[MergedStatus, ...]:
        """Each replica's verdict (:meth:`_each_replica`)."""

        async def verdict() -> tuple[str, MergedStatus]:
            status: MergedStatus = await handle.status.remote()
            return status.replica_id, status

        return tuple((await self._each_replica(verdict)).values())

    async def _finish(self, promotion: Promotion, reason: str) -> None:
        """A promotion that failed: its application deleted, then its state ``failed`` with why
        (a retry may start a new one of the same name)."""
        try:
            await asyncio.to_thread(_delete, promotion.app)
        except Exception as exc:  # still failed: never routed to; a later promotion replaces the application
            log.warning("the failed dedicated deployment %s was not deleted: %s", promotion.app, exc)
        promotion.state, promotion.reason, promotion.since = "failed", reason, time.time()
        await self._audit("promote", promotion, f"failed: {reason}")

    # -- demotion ---------------------------------------------------------------------------------

    async def demote(self, adapter_id: str, actor: str) -> Promotion:
        """Route ``adapter_id`` back to the shared pool and delete its dedicated deployment.
        409 unless it is served by one (a start under way must end first)."""
        promotion = self._by_id.get(adapter_id)
        if promotion is None or promotion.state != "merged":
            now = "no dedicated deployment" if promotion is None else f"a dedicated deployment {promotion.state}"
            raise ConflictError(f"adapter {adapter_id!r} is not promoted: it has {now}", param="id")
        before = (promotion.state, promotion.actor, promotion.since)
        promotion.state, promotion.actor, promotion.since = "stopping", actor, time.time()  # new requests: shared
        try:
            await asyncio.to_thread(_delete, promotion.app)
        except Exception as exc:  # Ray did not delete it: it still serves, and a demote may be asked again
            promotion.state, promotion.actor, promotion.since = before
            raise ServiceUnavailableError(
                f"the dedicated deployment of {adapter_id!r} was not deleted ({exc}); it still serves, retry",
                retry_after=5,
            ) from exc
        del self._by_id[adapter_id]
        await self._audit("demote", promotion, "ok")
        return promotion

    async def close(self) -> None:
        """Delete every dedicated deployment (for an embedding that stops the ingress itself;
        ``lorapage fleet`` deletes them by name when it stops, ``cli._stop``)."""
        for promotion in list(self._by_id.values()):
            await asyncio.to_thread(_delete, promotion.app)
        self._by_id.clear()

    async def _audit(self, action: str, promotion: Promotion, outcome: str) -> None:
        after = {"version": promotion.out().version, "deployment": promotion.app}
        if promotion.statuses and promotion.statuses[0].check is not None:
            check = promotion.statuses[0].check
            after["check"] = {k: check[k] for k in ("prompts", "tokens", "max_abs_dlogprob", "passed")}
        try:
            await asyncio.to_thread(
                self.registry.note, action, promotion.adapter_id, actor=promotion.actor, after=after, outcome=outcome
            )
        except Exception:
            log.exception("the audit row of %s %s was not written", action, promotion.key)


def _delete(app: str) -> None:
    """Delete a Serve application, waiting until it is gone (none of that name: nothing)."""
    if app in serve.status().applications:
        serve.delete(app)

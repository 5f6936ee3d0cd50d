"""``lorapage serve``'s dedicated tier at runtime: a merged engine beside the shared one, per promoted adapter.

``POST /v1/adapters/{id}/promote`` (the fleet's route, :mod:`lorapage.fleet.admin`) builds a
second :class:`~lorapage.engine.Engine` of the primary base in this process, as ``--base`` side
engines are (:mod:`lorapage.serve.engines`): its own pool and threads, the shared envelope off
(what a dedicated deployment is for), mirroring the one version it serves from the primary's
registry. It then runs :func:`~lorapage.engine.merge_check.merge_and_check` (the stored prompts
through the LoRA path, the merge, the same prompts on the plain base path, tokens and logprobs
compared): only once that passed do the version's requests go to it (:meth:`LocalDedicated.route`).
A failed check (or an engine that could not be built) leaves the adapter on the shared engine,
its state ``failed`` with why, and the merged engine closed. ``demote`` routes the adapter back
first, then closes the merged engine once its requests have ended (at most
``DRAIN_TIMEOUT_S``).

On first use (``lorapage serve --auto-promote``): an adapter outside the shared envelope registers
(tier ``dedicated``) and its first request starts the promotion; requests for it wait for the
check, at most ``--dedicated-wait`` seconds, then get a 503 with ``Retry-After`` (the shared
engine cannot serve its shape). Its merged engine's traffic counts in the primary's traffic table
and usage ledger, as the adapter's.

Hot enough (``--auto-promote`` too): every answer's output tokens are counted per adapter id
(:class:`~lorapage.fleet.promotion.PromotionPolicy`, the fleet ingress's rules, on an injected
clock); an adapter whose own rate stays at or above ``--promote-tokens-per-s`` (seed 001's 640,
a replica's worth) for ``--promote-after`` seconds gets its merged engine, while the shared engine
serves it until the check passed; one promoted that way (or on first use) whose rate stays below
``--demote-tokens-per-s`` for ``--demote-after`` seconds is demoted. Judged after an answer at
most every ``interval_s`` seconds, and on a timer (so an idle adapter is demoted). An admin's
promotion is left to the admin.

On one CUDA device the merged engine sizes its pool from what the others left
(``--gpu-memory-utilization`` counts every engine's memory): leave room for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from lorapage.adapters.names import parse_name
from lorapage.engine.merge_check import CHECK_PROMPTS, merge_and_check
from lorapage.errors import AdapterNotFoundError, ConflictError, LorapageError, ServiceUnavailableError
from lorapage.fleet.promotion import Decision, PromotionPolicy, PromotionRules
from lorapage.frontend.responses import PromotionOut

if TYPE_CHECKING:
    from lorapage.engine import Engine

log = logging.getLogger("lorapage.server")

ACTOR = "auto-promotion"  # who starts a promotion on first use (as the fleet's automatic ones)
DEPLOYMENT = "in-process"  # where a merged engine runs, as GET /v1/adapters/{id} names it
DRAIN_TIMEOUT_S = 60.0  # a demoted engine's requests get this long before it closes
DEFAULT_WAIT_S = 30.0  # a first request's wait for its merged engine (--dedicated-wait)
JUDGE_INTERVAL_S = 5.0  # how often the hot-enough rules are judged at most (as the fleet's ingress)
State = Literal["starting", "merged", "failed", "stopping"]


@dataclass
class LocalPromotion:
    """One adapter's merged engine (or the failure of its start)."""

    adapter_id: str
    key: str  # id@N: the version merged
    state: State
    actor: str
    since: float
    engine: Engine | None = None
    check: dict | None = None
    reason: str | None = None
    in_flight: int = 0  # its requests on the merged engine
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set once merged or failed

    def out(self) -> PromotionOut:
        return PromotionOut(
            state=self.state,
            version=int(parse_name(self.key)[1] or 0),
            deployment=DEPLOYMENT,
            since=int(self.since),
            actor=self.actor,
            check=self.check,
            reason=self.reason,
        )


def merged_engine(primary: Engine) -> Engine:
    """A fresh engine of ``primary``'s base and config for one merged version (blocking: it loads
    the weights): no state dir, its own download cache, the shared envelope and the shared pool's
    bound on adapter tokens off."""
    from lorapage.engine import Engine

    config = dataclasses.replace(
        primary.config,
        state_dir=None,
        adapter_cache_dir=tempfile.mkdtemp(prefix="lorapage-merged-cache-"),
        shared_envelope="",
        shared_max_cost_pct=None,
        max_adapter_tokens=None,
    )
    return Engine(config, adapter_roots=primary.admin.catalog.roots)


class LocalDedicated:
    """The promoted adapters of ``primary`` (this server's engine of the primary base), their
    merged engines, and which requests go to them."""

    def __init__(
        self,
        primary: Engine,
        *,
        auto: bool = False,
        wait_s: float = DEFAULT_WAIT_S,
        prompts: Sequence[str] = CHECK_PROMPTS,
        tolerance: float | None = None,
        build: Callable[[Engine], Engine] = merged_engine,
        rules: PromotionRules | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = JUDGE_INTERVAL_S,
    ) -> None:
        """``auto``: an adapter outside the shared envelope is promoted on first use, and one hot
        enough by ``rules`` (default: the design's) on its measured rate; ``wait_s``: how long
        requests wait for a merged engine their use started; ``clock``: the rates' clock."""
        self.primary, self.auto, self.wait_s = primary, auto, wait_s
        self.prompts, self.tolerance, self._build = tuple(prompts), tolerance, build
        self.policy = PromotionPolicy(rules or PromotionRules(), clock)
        self.interval_s = interval_s
        self._judged_at = -math.inf
        self._failed_seen: dict[str, float] = {}  # id -> the `since` of the failure already reported
        self._by_id: dict[str, LocalPromotion] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def promotions(self) -> Mapping[str, LocalPromotion]:
        """Every adapter id with a merged engine (or a failed start), and its state (read only)."""
        return MappingProxyType(self._by_id)

    def engines(self) -> list[Engine]:
        """The merged engines built (serving or draining)."""
        return [p.engine for p in self._by_id.values() if p.engine is not None]

    def route(self, key: str | None) -> LocalPromotion | None:
        """The promotion serving version ``key`` (id@N) merged, or None: the shared engine serves it."""
        promotion = self._by_id.get(parse_name(key)[0]) if key is not None else None
        if promotion is None or promotion.state != "merged" or promotion.key != key:
            return None
        return promotion

    # -- promotion --------------------------------------------------------------------------------

    def promote(self, key: str, actor: str) -> LocalPromotion:
        """Start the merged engine of version ``key``: answered at once (``starting``); it serves
        once its check passed. 409 while the id has one (or one starting or stopping)."""
        adapter_id, _ = parse_name(key)
        held = self._by_id.get(adapter_id)
        if held is not None and held.state != "failed":
            raise ConflictError(
                f"adapter {adapter_id!r} already has a dedicated deployment ({held.state}, version {held.key}); "
                f"demote it first (POST /v1/adapters/{adapter_id}/demote)",
                param="id",
            )
        promotion = LocalPromotion(adapter_id, key, "starting", actor, time.time())
        self._by_id[adapter_id] = promotion
        self._spawn(self._start(promotion))
        return promotion

    async def _start(self, promotion: LocalPromotion) -> None:
        """Build the engine, mirror the version, merge and check; then serve, or close it and say why."""
        engine: Engine | None = None
        try:
            row = self.primary.admin.catalog.row(promotion.key)
            engine = await asyncio.to_thread(self._build, self.primary)
            engine.admin.tiers.follow()  # its traffic is the adapter's: counted in the primary's table
            owner = self.primary.admin.catalog.index.owner(row.adapter_id)
            engine.admin.catalog.mirror(row.adapter_id, owner, row.version, [row])  # the one version, no weights read
            promotion.engine = engine
            check = await merge_and_check(engine, promotion.key, self.prompts, tolerance=self.tolerance)
            promotion.check = check.as_json()
            engine.admin.tiers.usage.take_traffic()  # the check's own runs are no one's traffic
            if not check.passed:
                raise ConflictError(check.line())
        except Exception as exc:  # the shared engine keeps serving it
            reason = exc.message if isinstance(exc, LorapageError) else f"{type(exc).__name__}: {exc}"
            log.warning("the dedicated deployment of %s did not start: %s", promotion.key, reason)
            promotion.engine = None
            promotion.state, promotion.reason, promotion.since = "failed", reason, time.time()
            promotion.ready.set()
            await self._audit("promote", promotion, f"failed: {reason}")
            if engine is not None:
                await _close(engine)
            return
        promotion.state, promotion.since = "merged", time.time()
        promotion.ready.set()
        log.info("adapter %s is served by its merged engine: %s", promotion.key, check.line())
        await self._audit("promote", promotion, "ok")

    async def serving(self, key: str) -> LocalPromotion | None:
        """Where a request for version ``key`` goes: its merged engine once it serves, else None
        (the shared engine). A version the shared engine refuses (outside the envelope) waits for
        its merged engine, started now when ``auto``, at most ``wait_s``; then a 503."""
        promotion = self._by_id.get(parse_name(key)[0])
        if promotion is not None and promotion.key == key and promotion.state == "merged":
            return promotion
        if self.primary.admin.has_version(key):  # the shared engine serves it
            return None
        if promotion is None or promotion.key != key or promotion.state == "failed":
            if not self.auto or (promotion is not None and promotion.key == key):
                return None  # the shared engine's refusal stands (a failed start: it says why in GET)
            promotion = self.promote(key, ACTOR)
        try:
            await asyncio.wait_for(promotion.ready.wait(), self.wait_s)
        except TimeoutError:
            pass
        if promotion.state == "merged":
            return promotion
        raise ServiceUnavailableError(
            f"adapter {key!r} is served by a dedicated deployment of its own (its shape is outside the shared "
            f"envelope), which is {promotion.state}"
            + (f": {promotion.reason}" if promotion.reason else "; retry shortly"),
            retry_after=max(1, round(self.wait_s)),
        )

    # -- hot enough ---------------------------------------------------------------------------------

    def observe(self, key: str | None, tokens: int) -> None:
        """One answer's output tokens on version ``key`` (None: the base, not counted), whichever
        engine served it; judges the rules if ``interval_s`` has passed since the last time."""
        if not self.auto or key is None:
            return
        self.policy.observe(parse_name(key)[0], tokens)
        if self.policy.clock() - self._judged_at >= self.interval_s:
            self.judge()

    def start(self) -> None:
        """With ``auto``: judge on a timer too, so that an adapter whose traffic stopped is demoted."""
        if self.auto:
            self._spawn(self._judge_forever())

    async def _judge_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.judge()
            except Exception:  # a registry hiccup: judged again next time
                log.exception("automatic promotion failed to judge")

    def judge(self) -> list[Decision]:
        """One judgement: failed starts reported to the rules (no retry for ``retry_after_s``),
        then the promotions (the adapter's current version) and demotions they call for, of the
        automatic promotions only."""
        self._judged_at = self.policy.clock()
        for adapter_id, promotion in self._by_id.items():
            if promotion.state == "failed" and self._failed_seen.get(adapter_id) != promotion.since:
                self._failed_seen[adapter_id] = promotion.since
                self.policy.failed(adapter_id)
        mine = {i for i, p in self._by_id.items() if p.state == "merged" and p.actor == ACTOR}
        busy = {i for i, p in self._by_id.items() if p.state != "failed"} - mine
        decisions = self.policy.decide(mine, busy)
        for decision in decisions:
            if decision.action == "demote":
                self._spawn(self._demote_quietly(decision.adapter_id))
            else:
                try:
                    key = self.primary.admin.catalog.row(decision.adapter_id).key
                    check_promotable(self.primary, key)
                    self.promote(key, ACTOR)
                except LorapageError as exc:
                    log.info("automatic promote of %s not done: %s", decision.adapter_id, exc.message)
                    continue
            log.info("automatic %s of %s: %s", decision.action, decision.adapter_id, decision.reason(self.policy.rules))
        return decisions

    async def _demote_quietly(self, adapter_id: str) -> None:
        try:
            await self.demote(adapter_id, ACTOR)
        except LorapageError as exc:  # demoted (or re-promoted) meanwhile
            log.info("automatic demote of %s not done: %s", adapter_id, exc.message)

    def _spawn(self, job: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- demotion ---------------------------------------------------------------------------------

    async def demote(self, adapter_id: str, actor: str) -> LocalPromotion:
        """Route ``adapter_id`` back to the shared engine, then close its merged engine once its
        requests end. 409 unless it is served merged."""
        promotion = self._by_id.get(adapter_id)
        if promotion is None or promotion.state != "merged":
            now = "no dedicated deployment" if promotion is None else f"a dedicated deployment {promotion.state}"
            raise ConflictError(f"adapter {adapter_id!r} is not promoted: it has {now}", param="id")
        promotion.state, promotion.actor, promotion.since = "stopping", actor, time.time()  # new requests: shared
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while promotion.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        del self._by_id[adapter_id]
        if promotion.engine is not None:
            await _close(promotion.engine)
        await self._audit("demote", promotion, "ok")
        return promotion

    async def close(self) -> None:
        """Close every merged engine (the server stops)."""
        for task in list(self._tasks):
            task.cancel()
        for promotion in list(self._by_id.values()):
            if promotion.engine is not None:
                await _close(promotion.engine)
        self._by_id.clear()

    async def _audit(self, action: str, promotion: LocalPromotion, outcome: str) -> None:
        after: dict = {"version": promotion.out().version, "deployment": DEPLOYMENT}
        if promotion.check is not None:
            after["check"] = {k: promotion.check[k] for k in ("prompts", "tokens", "max_abs_dlogprob", "passed")}
        try:
            await self.primary.admin.catalog.record(
                action, promotion.adapter_id, actor=promotion.actor, after=after, outcome=outcome
            )
        except Exception:
            log.exception("the audit row of %s %s was not written", action, promotion.key)


async def _close(engine: Engine) -> None:
    """Close a merged engine and remove its download cache."""
    await engine.close()
    shutil.rmtree(engine.config.adapter_cache_dir or "", ignore_errors=True)


def check_promotable(primary: Engine, key: str) -> None:
    """404 unless version ``key`` is registered on the primary's base (a version of a side
    base is not merged into the primary's weights)."""
    row = primary.admin.catalog.row(key)
    if row.base_digest != primary.digest:
        raise AdapterNotFoundError(
            f"adapter {key!r} runs on another base than {primary.base_name!r}; only the primary base's "
            "versions are promoted",
            param="id",
        )

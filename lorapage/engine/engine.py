"""The embedded engine: submit requests, stream outputs; one event loop owns all state.

The step loop runs as a task on the loop the engine is first used from. Each step it lets the
scheduling policy admit waiting requests, makes room for decodes (evicting idle adapters and
idle cached blocks, cheapest per page first, then preempting), and hands a
:class:`~lorapage.model.runner.StepPlan` to the single forward thread.
Adapter loads run beside it (see :mod:`lorapage.adapters.cache`) and never block it.

The engine is put together by the builders of :mod:`lorapage.engine.build`. What it shows:
generate / generate_batch / run_to_end / abort, stats / metrics / usage_rows, close, ``admin``
(adapter administration) and its shortcuts add_adapter / register_adapter, merge_into_base, the
tenants' weights and the front end's rejections; read-only, what servers, replay, the fleet and
the bases tools read of it: ``config``, ``tokenizer``, ``model_config``, ``base_name``,
``digest``, ``max_model_len``, ``device``, ``merged_adapter``, ``step_reserve_bytes``. Everything
else is a part, reached through the read-only ``debug`` view (tests, benchmarks, diagnostics).
``load_adapter`` is kept as a deprecated alias of ``admin.load``, which replaced it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from lorapage.adapters.cache import AdapterInfo
from lorapage.adapters.state_lock import StateDirLock
from lorapage.config import EngineConfig
from lorapage.engine.admin import AdapterAdmin
from lorapage.engine.build import (
    build_adapters,
    build_base,
    build_forward,
    build_memory,
    build_scheduling,
    build_sizing,
    load_model,
)
from lorapage.engine.build_catalog import build_admin, build_catalog
from lorapage.engine.debug import EngineDebug
from lorapage.engine.devices import build_threads
from lorapage.engine.merging import MergedWeights, merge_tensors
from lorapage.engine.stats import EngineMetrics, EngineStats, gather_stats
from lorapage.engine.step_loop import Wakeup
from lorapage.errors import AdapterTokensOverSharedLimitError, ConflictError, EngineClosedError
from lorapage.model.config import ModelConfig
from lorapage.model.merge import MergeFn, merge_adapter
from lorapage.model.tokenizer import Tokenizer
from lorapage.omp_env import release_thread_team
from lorapage.registry.catalog import REGISTRATION_TIMEOUT_S
from lorapage.request import PromptProgress, Request, RequestOutput
from lorapage.sampling_params import SamplingParams
from lorapage.scheduler import MeteredPolicy, VtcScheduler
from lorapage.sources import AdapterRoots
from lorapage.usage import Usage

log = logging.getLogger("lorapage.engine")
_BRANCHES_PER_TURN = 8  # branches of one prompt built between two turns of the event loop


class Engine:
    """One base model, many LoRA adapters, continuous batching over one unified page pool."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        tenant_weights: Mapping[str, float] | None = None,
        adapter_roots: AdapterRoots | None = None,
    ) -> None:
        """``adapter_roots``: the directories adapter versions may be read from, per owner, at
        registration and at every load (a server's ``--adapter-root``; default: any directory,
        for an embedded engine whose caller is trusted)."""
        self._config = config = config or EngineConfig()
        # First: a second engine on one state dir refuses to start before loading anything.
        self._state_lock = StateDirLock(Path(config.state_dir)) if config.state_dir is not None else None
        self._clock = clock
        self._base = base = build_base(config)
        self._sizing = sizing = build_sizing(config, base)
        model = load_model(base, sizing)  # weights first: on CUDA the pool is sized from what they leave
        self._memory = memory = build_memory(config, base, sizing, clock)
        forward = build_forward(config, base, sizing, model, memory)
        self._threads = threads = build_threads(config, sizing.device, sizing.tensor_parallel_size)
        self._wake_up = wakeup = Wakeup()  # rung by requests, aborts and finished adapter loads
        self._adapters = adapters = build_adapters(
            config, base, sizing, memory, threads, clock, adapter_roots, wakeup, model, forward.parallel
        )
        catalog = build_catalog(config, base, threads, adapters, self._check_open)  # the registry is its alone
        self._catalog, self._tiers = catalog.catalog, catalog.tiers
        self._steps = steps = build_scheduling(
            config, base, sizing, memory, forward, threads, adapters, catalog.tiers, wakeup, clock, tenant_weights
        )
        self._runner = forward.runner
        self._admin = build_admin(config, threads, adapters, catalog, steps, self._check_open)
        self._debug = EngineDebug.of(clock, sizing, memory, forward, threads, adapters, steps, catalog)
        self._merged = MergedWeights()  # a dedicated deployment's (merge_into_base)
        self._closed = False
        # This thread packed the weights on the forward's thread count: its OpenMP workers would
        # outlive the build and make libgomp throttle the forward's spin (lorapage.omp_env).
        release_thread_team()

    # -- what callers read ----------------------------------------------------------------------

    @property
    def admin(self) -> AdapterAdmin:
        """Adapter administration: the one interface front ends manage adapters through."""
        return self._admin

    @property
    def debug(self) -> EngineDebug:
        """The engine's parts, read-only, for tests and diagnostics (:mod:`lorapage.engine.debug`)."""
        return self._debug

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def tokenizer(self) -> Tokenizer:
        return self._base.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self._base.model_config

    @property
    def base_name(self) -> str:
        """The base's directory name: how requests, metrics and the fleet name it."""
        return self._base.name

    @property
    def digest(self) -> str:
        """sha256 of the base checkpoint's weight files (adapters are pinned to it)."""
        return self._base.digest()

    @property
    def max_model_len(self) -> int:
        return self._sizing.max_model_len

    @property
    def device(self) -> torch.device:
        return self._sizing.device

    @property
    def merged_adapter(self) -> str | None:
        """The version merged into the weights (a dedicated deployment), or None: the shared pool."""
        return self._merged.adapter

    @property
    def step_reserve_bytes(self) -> int:
        """What a CUDA pool left beside it for the steps (activations and headroom), allocated only
        as steps run: an engine sized after this one on the same device must leave it (serve --base)."""
        return self._memory.step_reserve_bytes

    # -- adapters -------------------------------------------------------------------------------

    def add_adapter(
        self, name: str, path: str | Path, *, owner: str | None = None, expected_base_digest: str | None = None
    ) -> AdapterInfo:
        """Register a PEFT LoRA directory as a new version of ``name``, validated now in the calling
        thread (:meth:`AdapterCatalog.add <lorapage.registry.catalog.AdapterCatalog.add>`)."""
        version = self._catalog.add(name, path, owner=owner, expected_base_digest=expected_base_digest)
        return self.admin.info(version.key)

    async def register_adapter(
        self,
        name: str,
        source: str | Path,
        *,
        owner: str | None = None,
        sha256: str | None = None,
        expected_base_digest: str | None = None,
        activate: bool = True,
        timeout_s: float = REGISTRATION_TIMEOUT_S,
        actor: str | None = None,
    ) -> AdapterInfo:
        """:meth:`add_adapter` without holding the event loop, from a directory or a source URI
        (:meth:`AdapterCatalog.register <lorapage.registry.catalog.AdapterCatalog.register>`);
        ``created`` False: the content of an existing version, which is returned."""
        version, created = await self._catalog.register(
            name,
            source,
            owner=owner,
            sha256=sha256,
            expected_base_digest=expected_base_digest,
            activate=activate,
            timeout_s=timeout_s,
            actor=actor,
        )
        return dataclasses.replace(self.admin.info(version.key), created=created)

    async def load_adapter(self, name: str, *, actor: str | None = None) -> None:
        """Deprecated: :meth:`AdapterAdmin.load <lorapage.engine.admin.AdapterAdmin.load>`
        (``engine.admin.load``), which replaced it: make ``name`` resident in the pool now."""
        warnings.warn(
            "Engine.load_adapter is deprecated; use engine.admin.load(name) instead", DeprecationWarning, stacklevel=2
        )
        await self.admin.load(name, actor=actor)

    # -- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        adapter: str | None = None,
        sampling: SamplingParams | None = None,
        *,
        tenant: str | None = None,
        request_id: str | None = None,
        prefix_group: str | None = None,
        progress: PromptProgress | None = None,
        final_only: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs (cumulative; ``delta_text`` is the new text); with
        ``final_only`` (vLLM's ``RequestOutputKind.FINAL_ONLY``) only the finished one, which costs
        the event loop no output per step (``n`` > 1 streams every sequence's outputs as ever).

        Cached prompt prefixes are shared only among one tenant's requests (without ``tenant``:
        the default tenant's), or among the requests that name one ``prefix_group``.
        ``request_id`` must be unique among the requests in flight, whatever their tenant (a
        server makes its own rather than take a client's). Stopping iteration early (a client
        went away) aborts the request and frees its pages. ``progress``, when given, holds the
        prompt tokens computed for it once the generator ends (what a quota charges a request cut
        before its first token). With ``n`` > 1 the first sequence computes the prompt (and its
        prompt logprobs, when asked: every sequence's outputs carry that one list) and the others
        take its KV blocks.
        """
        self._check_open()
        self._steps.step_loop.bind()
        sampling = sampling or SamplingParams()
        if sampling.logprobs_mode is None:  # the engine's (vLLM's --logprobs-mode)
            sampling = dataclasses.replace(sampling, logprobs_mode=self._config.logprobs_mode)
        if adapter is not None:
            adapter = self._catalog.resolve_version(adapter)  # this request runs on this version to its end
        merged = self._merged.adapter
        self._merged.check_weights(merged)
        if merged is not None:
            self._merged.check_route(adapter)
            adapter = None  # the weights hold the adapter: the LoRA path would add it twice
        self._check_adapter_tokens(adapter, sampling)
        self._steps.intake.check(adapter, sampling)
        try:
            ids, constraints, bad_words = await asyncio.gather(
                self._steps.intake.prompt_ids(prompt),
                self._steps.intake.constraints(sampling, tenant),
                self._steps.intake.bad_words_ids(sampling),
            )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                raise EngineClosedError("the engine was closed while the prompt was tokenized") from None
            raise  # the caller's own cancellation
        self._check_open()  # closed while the prompt was tokenized
        self._merged.check_weights(merged)  # the route was decided on the weights as they were before tokenizing

        intake = self._steps.intake
        first_sampling = sampling if sampling.n == 1 else dataclasses.replace(sampling, n=1)
        req = intake.build(
            ids,
            adapter,
            first_sampling,
            tenant,
            request_id,
            prefix_group,
            constraint=constraints[0],
            bad_words_ids=bad_words,
        )
        req.merged_adapter = merged  # charged to the merged version, though it runs on the base path

        def build(k: int) -> Request:
            """Branch k of the prompt: its own seed; the prompt's logprobs are the first's."""
            seed = None if sampling.seed is None else sampling.seed + k
            branch_sampling = dataclasses.replace(first_sampling, seed=seed, prompt_logprobs=None)
            rid = f"{req.request_id}-{k}"
            branch = intake.branch(req, branch_sampling, rid, constraints[k])
            branch.merged_adapter = merged
            return branch

        req.outputs.final_only = final_only and sampling.n == 1  # the branches start from the first's first output
        self._steps.planner.submit(req)
        self._wake_up()
        if sampling.n == 1:
            finished = False
            try:
                while not finished:
                    out = await req.outputs.get()
                    finished = out.finished
                    yield out
            finally:
                if not finished:
                    self.abort(req.request_id)
                if progress is not None:
                    progress.computed = req.prompt_computed
            return
        async for out in self._branches(req, build, sampling.n, progress):
            yield out

    async def _branches(
        self, first: Request, build: Callable[[int], Request], n: int, progress: PromptProgress | None
    ) -> AsyncIterator[RequestOutput]:
        """The outputs of ``n`` sequences from one prompt, as they come (``index`` says which). The
        first computes the prompt; the others are submitted once it has, so they take its full
        KV blocks from the prefix cache and compute only what the last, partial block holds."""
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        requests = [first]

        async def pump(k: int, req: Request) -> None:
            try:
                while True:
                    out = await req.outputs.get()
                    queue.put_nowait((k, out))
                    if out.finished:
                        return
            except BaseException as exc:  # the branch's own error, raised to the caller
                queue.put_nowait((k, exc))

        pumps = [asyncio.ensure_future(pump(0, first))]
        done = 0
        try:
            while done < n:
                k, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if k == 0 and len(requests) == 1:  # the prompt is computed: branch off
                    for j in range(1, n):
                        requests.append(build(j))
                        self._steps.planner.submit(requests[j])
                        pumps.append(asyncio.ensure_future(pump(j, requests[j])))
                        if j % _BRANCHES_PER_TURN == 0:
                            self._wake_up()
                            await asyncio.sleep(0)  # the loop's other work between batches of branches
                    self._wake_up()
                done += item.finished
                # One copy of the prompt's logprobs, computed by the first branch, in every branch's outputs.
                yield dataclasses.replace(item, index=k, prompt_logprobs=first.prompt_logprobs)
        finally:
            for task in pumps:
                task.cancel()
            for req in requests:
                if req.finish_reason is None:
                    self.abort(req.request_id)
            if progress is not None:
                progress.computed = max(r.prompt_computed for r in requests)  # the prompt, computed once

    def generate_batch(
        self,
        items: Iterable[tuple[str | list[int], str | None]],
        sampling: SamplingParams | None = None,
        *,
        tenant: str | None = None,
    ) -> list[RequestOutput]:
        """Run ``(prompt, adapter)`` pairs together and return their final outputs, in order.

        For plain scripts: call it where no event loop is running in this thread.
        """

        async def run_all():
            return await asyncio.gather(*(self.run_to_end(p, a, sampling, tenant=tenant) for p, a in items))

        return asyncio.run(run_all())

    async def run_to_end(
        self,
        prompt: str | list[int],
        adapter: str | None = None,
        sampling: SamplingParams | None = None,
        *,
        tenant: str | None = None,
    ) -> RequestOutput:
        """One request's final output (:meth:`generate` with ``final_only``)."""
        last = None
        async for last in self.generate(prompt, adapter, sampling, tenant=tenant, final_only=True):
            pass
        assert last is not None  # a request ends with a finished output, or raises
        return last

    def _check_adapter_tokens(self, adapter: str | None, sampling: SamplingParams) -> None:
        """``max_adapter_tokens``: long generations on an adapter belong to its dedicated tier."""
        limit = self._config.max_adapter_tokens
        if adapter is None or limit is None or sampling.max_tokens <= limit:
            return
        adapter_id = adapter.partition("@")[0]
        raise AdapterTokensOverSharedLimitError(
            f"max_tokens {sampling.max_tokens} is over this shared pool's limit of {limit} tokens per request on an "
            f"adapter (--max-adapter-tokens); ask for at most {limit}, or serve {adapter_id!r} on its dedicated "
            f"tier (lorapage serve --merge {adapter_id}=DIR), where it runs merged into the base with no such limit",
            param="max_tokens",
        )

    async def merge_into_base(self, name: str, *, merge: MergeFn = merge_adapter) -> str:
        """Make this engine a dedicated deployment of the version ``name`` names: its weights are
        merged into the base's, in place and for good (``merge``: :func:`~lorapage.model.merge.merge_adapter`).
        From then on requests naming it run on the plain base path, and every other model (the base
        included) is refused 404. Its files are read again, checked against the registered digest.
        Returns the version's key; refused (409) while any request is in flight."""
        self._check_open()
        key = self._catalog.resolve_version(name)
        if self._merged.adapter is not None:
            raise ConflictError(f"this engine already holds {self._merged.adapter!r} merged into its weights")
        if self._sizing.tensor_parallel_size > 1:
            raise ConflictError("merging an adapter into the base is not done under tensor parallelism yet")
        if self._steps.planner.requests:
            raise ConflictError("requests are in flight: the weights they run on cannot change under them")
        entry = self._adapters.cache.get(key)
        self._merged.merging = True
        try:
            tensors, scales = await merge_tensors(key, entry, self._adapters.files, self._threads.io)
            # On the forward thread: ordered with the steps (and graph replays) on its stream.
            await asyncio.get_running_loop().run_in_executor(
                self._threads.forward, merge, self._runner.ctx.model, tensors, scales
            )
            self._steps.intake.weights_changed(entry.cache_id)  # blocks the base cached before are of other weights
            self._merged.adapter = key
        finally:
            self._merged.merging = False
        log.info("adapter %s merged into the base weights: this engine is its dedicated deployment", key)
        return key

    def record_merge_check(self, check: Mapping[str, Any]) -> None:
        """Keep what the merged version's equivalence check found (:mod:`lorapage.engine.merge_check`),
        for ``stats().merged_deployment``."""
        self._merged.check = check

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages are freed within one step."""
        self._steps.planner.abort(request_id)
        self._wake_up()

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """New VTC shares (a reloaded tenants file); FCFS has none."""
        policy = self._steps.policy
        inner = getattr(policy, "policy", policy)
        if hasattr(inner, "set_tenant_weights"):
            inner.set_tenant_weights(weights)

    def metrics(self) -> EngineMetrics:
        """The live sources ``/metrics`` reads this engine through (stats, scheduler, VTC counters,
        adapters), for :func:`lorapage.frontend.metrics.register_engine_collectors`."""
        return EngineMetrics(self.stats, self._steps.metrics, self._vtc_counters, self._adapters.metrics)

    def _vtc_counters(self) -> dict[str, float]:
        """Each tenant's VTC virtual counter now (none under FCFS), as ``/metrics`` exports them."""
        policy = self._steps.policy
        inner = policy.policy if isinstance(policy, MeteredPolicy) else policy
        return inner.counters() if isinstance(inner, VtcScheduler) else {}

    def usage_rows(
        self, *, tenants: set[str] | None = None, adapters: set[str] | None = None, since_hour: int | None = None
    ) -> list[tuple[tuple[int, str, str], Usage]]:
        """Cost attribution, ``((hour, tenant, adapter), usage)`` in order (see
        :mod:`lorapage.usage.ledger`), residency charged up to now; hours use the engine's clock."""
        now, usage = self._clock(), self._adapters.usage
        usage.record_residency(now, self._adapters.residency.slots.resident_pages())
        usage.prune(now)
        return usage.query(tenants=tenants, adapters=adapters, since_hour=since_hour)

    def stats(self) -> EngineStats:
        """Resident and host-RAM adapters, queue depth, running sequences, pool use, evictions."""
        return gather_stats(self._clock(), self._memory, self._adapters, self._steps, self._merged.check)

    async def close(self) -> None:
        """Abort everything in flight and stop the step loop and worker threads."""
        self._closed = True
        planner, forward = self._steps.planner, self._threads.forward
        for rid in list(planner.requests):
            planner.abort(rid)
        self._wake_up()
        await self._steps.step_loop.stop()
        try:  # wait, without blocking the loop, for the step in flight and any queued copies
            await asyncio.wrap_future(forward.submit(lambda: None))
        except RuntimeError:  # closed before: the forward thread is gone already
            pass
        forward.shutdown(wait=True)  # idle by now: returns at once
        # Requests aborted while a step was in flight waited for that step's results, which the
        # cancelled loop will never apply: finish them now that the forward thread is idle.
        planner.abort_all_after_close()
        try:  # the traffic counted since the last write, before the catalog closes its registry
            await self._tiers.stop()
        except Exception:
            log.exception("traffic tiers: the last traffic counts could not be written")
        self._threads.shutdown_workers()
        self._runner.close()
        self._adapters.cache.drop_host_copies()
        await self._adapters.sources.close()
        self._catalog.close()  # its registry: waits for a commit in flight
        if self._state_lock is not None:
            self._state_lock.release()  # the state dir is another server's to take from here

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine has been closed")

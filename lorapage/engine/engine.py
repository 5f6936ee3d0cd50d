"""The embedded engine: submit requests, stream outputs; one event loop owns all state.

The step loop runs as a task on the loop the engine is first used from. Each step it lets the
scheduling policy admit waiting requests, makes room for decodes (evicting idle adapters and
idle cached blocks, cheapest per page first, then preempting), and hands a
:class:`~lorapage.model.runner.StepPlan` to the single forward thread.
Adapter loads run beside it (see :mod:`lorapage.adapters.cache`) and never block it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import torch

from lorapage.adapters.binding import BaseBinding, BaseNames, load_base_names
from lorapage.adapters.cache import AdapterCache, AdapterEntry, AdapterInfo
from lorapage.adapters.catalog import AdapterCatalog
from lorapage.adapters.envelope import Envelope
from lorapage.adapters.layout import max_adapter_pages
from lorapage.adapters.loader import AdapterLoader, content_digest
from lorapage.adapters.metrics import AdapterMetrics
from lorapage.adapters.peft_format import at_path, load_adapter_tensors, read_weights
from lorapage.adapters.pins import PinBounds
from lorapage.adapters.prepare import REGISTRATION_TIMEOUT_S, VersionPreparer
from lorapage.adapters.registry import REGISTRY_FILE, Registry
from lorapage.adapters.residency import Residency, ResidencyLimits
from lorapage.adapters.sources import (
    ANYWHERE,
    AdapterRoots,
    AdapterSources,
    DownloadLimits,
    FileSource,
    parse_source,
)
from lorapage.adapters.state_lock import StateDirLock
from lorapage.adapters.tiers import TierRules
from lorapage.adapters.value import ReloadCosts, Stage
from lorapage.config import MAX_DERIVED_LORA_SLOTS, EngineConfig
from lorapage.engine.admin import AdapterAdmin
from lorapage.engine.devices import (
    DTYPES,
    forward_thread,
    forward_thread_count,
    io_thread,
    io_thread_count,
    resolve_device,
    shorten_switch_interval,
    usable_cores,
)
from lorapage.engine.intake import RequestIntake
from lorapage.engine.stats import EngineMetrics, EngineStats
from lorapage.engine.step_loop import StepLoop
from lorapage.engine.step_scheduler import StepLimits, StepScheduler
from lorapage.engine.tiering import TierKeeper
from lorapage.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    AdapterSourceError,
    AdapterTokensOverSharedLimitError,
    ConflictError,
    EngineClosedError,
    LorapageError,
)
from lorapage.kernels.backend import select_backend
from lorapage.memory.pages import PageKind
from lorapage.memory.pool import PagePool, adapter_page_size
from lorapage.memory.prefix_cache import PrefixCache
from lorapage.memory.reclaim import Reclaim, RecomputeCost
from lorapage.memory.sizing import POOL_HEADROOM_BYTES, lora_slots, pages_for_memory, step_activation_bytes
from lorapage.model.config import ModelConfig, context_length
from lorapage.model.llama import LlamaModel, lora_h_width
from lorapage.model.loader import load_state_dict, model_digest
from lorapage.model.lora_tables import LoraTables
from lorapage.model.merge import MergeFn, merge_adapter
from lorapage.model.runner import ModelRunner
from lorapage.model.tokenizer import Tokenizer
from lorapage.omp_env import SPINCOUNT_ENV, spin_setting
from lorapage.request import PromptProgress, Request, RequestOutput
from lorapage.sampling_params import SamplingParams
from lorapage.scheduler import MeteredPolicy, SchedulerMetrics, SchedulerPolicy, VtcConfig, VtcScheduler, make_policy
from lorapage.structured.grammars import GrammarCompiler
from lorapage.usage import Usage, UsageLedger

CPU_POOL_BYTES = 4 << 30  # auto-sized pools on CPU stay under this
MAX_PREFETCHES = 2  # prefetches into host RAM use at most this many I/O threads (and always leave one)

log = logging.getLogger("lorapage.engine")


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
        self.config = config = config or EngineConfig()
        # First: a second engine on one state dir refuses to start before loading anything.
        self._state_lock = StateDirLock(Path(config.state_dir)) if config.state_dir is not None else None
        self.adapter_roots = adapter_roots if adapter_roots is not None else ANYWHERE
        self.clock = clock
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.lora_dtype = DTYPES[config.resolved_lora_dtype]
        model_dir = Path(config.model)
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        self.base_name = model_dir.name
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.base_binding = BaseBinding(BaseNames.of_base(model_dir, _base_names(config)), config.allow_unbound)
        self.max_model_len = context_length(mc, config.max_model_len)
        eos = mc.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids: frozenset[int] = frozenset(t for t in eos if t is not None)
        self._digest: str | None = None
        # What a CUDA pool left beside it for the steps (activations and headroom), allocated only as
        # steps run: an engine sized after this one on the same device must leave it (serve --base).
        self.step_reserve_bytes = 0
        bs = config.block_size
        page_size = 2 * bs * mc.kv_size
        # A page holds more adapter elements when adapters are narrower than KV.
        adapter_pages = max_adapter_pages(
            mc, config.max_lora_rank, adapter_page_size(page_size, self.dtype, self.lora_dtype)
        )
        max_blocks = -(-self.max_model_len // bs)
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(2048, self.max_model_len)
        if self.max_num_batched_tokens < self.max_model_len and not config.enable_chunked_prefill:
            # Without chunked prefill a whole prompt (or a preempted sequence's recompute) must fit in one step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) unless enable_chunked_prefill is on"
            )
        if self.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({config.max_num_seqs}): every running sequence decodes one token per step"
            )
        # Weights first: on CUDA the pool is sized from the memory they leave.
        model = LlamaModel(mc, load_state_dict(model_dir, self.dtype), self.device, self.dtype, self.max_model_len)
        num_pages = self._num_pages(adapter_pages, max_blocks, page_size)
        self.pool = PagePool(mc.num_layers, num_pages, page_size, self.dtype, self.device, self.lora_dtype)
        # Lora slots: how many adapters may be resident at once (max_loras is per batch, the scheduler's).
        self.max_resident_loras = lora_slots(
            config.max_loras, config.max_resident_loras, self.pool.capacity, adapter_pages, MAX_DERIVED_LORA_SLOTS
        )
        self.tables = LoraTables(mc, self.max_resident_loras, adapter_pages, self.device)
        self.ops = select_backend(config.kernel_backend, self.device, self.dtype)
        self.runner = ModelRunner(
            model,
            self.pool,
            self.tables,
            self.ops,
            bs,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            max_blocks,
            lora_h_width(mc, config.max_lora_rank),
        )
        if self.device.type == "cuda" and self.ops.captures_graphs and not config.enforce_eager:
            with torch.cuda.device(self.device):
                self.runner.capture_decode_graphs(config.max_num_seqs)
        shorten_switch_interval(config.gil_switch_interval_s)  # the forward thread re-takes the GIL after each op
        self.forward_threads = forward_thread_count(config.num_threads, self.device)
        self._forward = ThreadPoolExecutor(
            1,
            thread_name_prefix="lorapage-forward",
            initializer=forward_thread,
            initargs=(self.device, self.forward_threads),
        )
        self.io_threads = io_thread_count(config.io_threads, self.device, self.forward_threads)
        self._io = ThreadPoolExecutor(
            self.io_threads, thread_name_prefix="lorapage-io", initializer=io_thread, initargs=(self.device,)
        )
        # On a CPU the copies into the pool get a thread of their own: queued behind file reads
        # on the I/O pool, a load whose read was done waited for every read queued after it (the
        # S-LoRA replay: a wave of ten cold adapters all became resident together, ~0.5 s in,
        # instead of one by one from ~70 ms). A copy is ~1 ms; the forward's priority.
        self._copies = ThreadPoolExecutor(1, thread_name_prefix="lorapage-copy") if self.device.type == "cpu" else None
        # Prompts are tokenized apart from file reads too: with every I/O thread stuck on a slow
        # file, a text request for a resident adapter (or the base) must still get in.
        self._tokenize = ThreadPoolExecutor(self.io_threads, thread_name_prefix="lorapage-tokenize")
        log.info(
            "threads: forward %d intra-op (%s), %d I/O, %d tokenizer; %d usable cores; %s %s",
            self.forward_threads,
            "num_threads" if config.num_threads is not None else "torch's setting",
            self.io_threads,
            self.io_threads,
            usable_cores(),
            SPINCOUNT_ENV,
            spin_setting(),  # what lets 2+ threads beat one (lorapage.omp_env)
        )
        # Memory first: the pool's idle cached blocks and idle adapters are given back in one
        # ranking (Reclaim), which the adapters' residency rules call; then the adapters' rules,
        # the loader that carries them out, the cache of registered versions, the catalog.
        self.prefix_cache = PrefixCache(self.pool, clock)
        page_bytes = mc.num_layers * page_size * self.pool.storage.element_size()
        self.page_bytes = page_bytes  # one pool page across every layer (stats: adapter bytes)
        recompute = RecomputeCost(page_bytes, bs)  # fed measured prefill timings by the step loop
        self.reclaim = Reclaim(self.pool, self.prefix_cache, recompute)
        costs = ReloadCosts(page_bytes)
        self.residency = Residency(
            ResidencyLimits(
                max_resident_loras=self.max_resident_loras,
                max_cpu_loras=config.max_cpu_loras,
                max_cpu_lora_bytes=config.max_cpu_lora_bytes,
                adapter_wait_s=config.adapter_wait_s,
                max_prefetches=max(0, min(MAX_PREFETCHES, self.io_threads - 1)),
                pins=PinBounds(
                    self.pool.capacity,
                    self.max_resident_loras,
                    config.max_pinned_fraction,
                    sequence_pages=max_blocks,
                    max_adapter_pages=adapter_pages,
                ),
            ),
            self.pool,
            self.reclaim,
            costs,
        )
        cache_dir = config.adapter_cache_dir or (
            str(Path(config.state_dir) / "adapter-cache") if config.state_dir is not None else None
        )
        self.sources_cache_dir = cache_dir
        self.sources = AdapterSources(
            Path(cache_dir) if cache_dir is not None else None,
            config.adapter_cache_bytes,
            limits=DownloadLimits(
                config.max_adapter_download_bytes,
                timeout_s=config.adapter_download_timeout_s,
                min_bytes_per_s=config.min_adapter_download_bytes_per_s,
                allow_private=config.allow_private_adapter_sources,
            ),
            adapter_roots=self.adapter_roots,
            executor=self._io,
            s3_endpoint_url=config.s3_endpoint_url,
            hf_endpoint=config.hf_endpoint,
        )
        self.usage = UsageLedger(wall_offset=time.time() - clock())  # hours of the calendar
        self.adapter_metrics = AdapterMetrics(
            config.metrics_top_adapters,
            usage=self.usage,
            bytes_downloaded=lambda: self.sources.stats().bytes_downloaded,
            pinned_pages=self.residency.pinned_pages,
            projected_costs=lambda: self.catalog.current_costs(),
        )
        loader = AdapterLoader(
            self.pool,
            self.tables,
            self.lora_dtype,
            costs,
            io_executor=self._io,
            run_on_device=self._run_on_device,
            locate=self._locate_version,
        )
        self.adapters = AdapterCache(
            mc,
            self.pool,
            self.residency,
            loader,
            max_lora_rank=config.max_lora_rank,
            envelope=Envelope.from_config(config, mc, self.dtype.itemsize, self.lora_dtype.itemsize),
            on_ready=self._wake_up,
            clock=clock,
            sequence_pages=max_blocks,
            metrics=self.adapter_metrics,
            landed=self.sources.cached,
        )
        state = Path(config.state_dir) / REGISTRY_FILE if config.state_dir is not None else ":memory:"
        registry = Registry(state)  # the catalog's; the traffic tiers write their table to it too
        preparer = VersionPreparer(
            self.adapters,
            self.base_binding,
            self.sources,
            roots=self.adapter_roots,
            download_cache=self.sources_cache_dir,
            base_digest=lambda: self.digest,
            io_executor=self._io,
            check_open=self._check_open,
        )
        # Restores every version committed before a restart (reading no weights).
        self.catalog = AdapterCatalog(
            self.adapters,
            registry,
            preparer,
            base_digest=lambda: self.digest,
            io_executor=self._io,
            locate=self._locate_version,
            check_open=self._check_open,
        )
        self.scheduler_metrics = SchedulerMetrics()
        self.policy: SchedulerPolicy[Request] = make_policy(
            config.scheduler,
            vtc=VtcConfig(
                max_loras=config.max_loras,
                reserved_tail_lanes=config.reserved_tail_lanes,
                age_deadline_s=config.lane_age_deadline_s,
            ),
            tenant_weights=tenant_weights,
            metrics=self.scheduler_metrics,
        )
        limits = StepLimits(
            bs,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            self.eos_token_ids,
            chunked_prefill=config.enable_chunked_prefill,
        )
        self.scheduler = StepScheduler(
            self.policy,
            self.adapters,
            self.pool,
            limits,
            clock,
            metrics=self.scheduler_metrics,
            prefix_cache=self.prefix_cache,
            usage=self.usage,
        )
        # The traffic table and tiers: counts batched from the ledger, written and judged off the loop.
        self.tiers = TierKeeper(
            TierRules.from_config(config),
            self.usage,
            registry,
            self.adapters,
            self._io,
            self._wall_clock,
            interval_s=config.tier_interval_s,
            retention_hours=config.traffic_retention_hours,
        )
        self.step_loop = StepLoop(
            self.scheduler,
            self.runner,
            self._forward,
            on_new_loop=self._on_new_loop,
            on_prefill=recompute.observe,
        )
        # Structured output: grammars compile on a thread of their own, never behind prompts.
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="lorapage-grammar")
        # The grammar engine knows the tokenizer's tokens only: an EOS id past them (a config whose
        # vocabulary is padded beyond the tokenizer's) is left to the engine's own stop check.
        known = self.tokenizer.backend.get_vocab_size(with_added_tokens=True)
        grammar_eos = tuple(sorted(t for t in self.eos_token_ids if t < known))
        if not grammar_eos and self.tokenizer.eos_token_id is not None:
            grammar_eos = (self.tokenizer.eos_token_id,)
        self.grammars = GrammarCompiler(
            self.tokenizer.backend.to_str(), mc.vocab_size, grammar_eos, self._grammar_thread
        )
        self.intake = RequestIntake(
            tokenizer=self.tokenizer,
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            block_size=bs,
            max_queue_len=config.max_queue_len,
            pool=self.pool,
            adapters=self.adapters,
            num_waiting=self.policy.num_waiting,
            in_flight=self.scheduler.requests.keys(),
            tokenize=self._tokenize,
            clock=clock,
            eos_token_ids=self.eos_token_ids,
            grammars=self.grammars,
            # The cache lives as long as this engine, on one base: its name suffices to tell it apart.
            prefix_namespace=f"base|{self.base_name}".encode() if config.enable_prefix_caching else None,
        )
        # A dedicated deployment: the version merged into the weights (merge_into_base), and what
        # its equivalence check found (set by whoever ran it; lorapage.engine.merge_check).
        self.merged_adapter: str | None = None
        self.merge_check: dict | None = None
        self._merging = False  # new requests are refused while the weights change
        self._closed = False
        # Adapter administration, the one interface front ends manage adapters through.
        self.admin = AdapterAdmin(
            self.catalog,
            self.adapters,
            self.tiers,
            check_open=self._check_open,
            bind=self.step_loop.bind,
            wall_clock=self._wall_clock,
        )

    def _num_pages(self, adapter_pages: int, max_blocks: int, page_size: int) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        # Room for the adapters asked to be resident at once (an explicit max_resident_loras), else for
        # one batch's (max_loras); a derived max_resident_loras then follows the pool (lora_slots).
        adapters = self.config.max_resident_loras or self.config.max_loras
        want = 1 + self.config.max_num_seqs * max_blocks + adapters * adapter_pages
        mc, elem = self.model_config, torch.finfo(self.dtype).bits // 8
        per_page = mc.num_layers * page_size * elem
        if self.device.type != "cuda":
            return min(want, CPU_POOL_BYTES // per_page)
        free, total = torch.cuda.mem_get_info(self.device)
        activations = step_activation_bytes(
            self.max_num_batched_tokens,
            self.config.max_num_seqs,
            mc.hidden_size,
            mc.q_size + 2 * mc.kv_size,
            mc.intermediate_size,
            mc.vocab_size,
            elem,
        )
        self.step_reserve_bytes = activations + POOL_HEADROOM_BYTES
        return pages_for_memory(
            want,
            per_page,
            total=total,
            free=free,
            utilization=self.config.gpu_memory_utilization,
            activations=activations,
            headroom=POOL_HEADROOM_BYTES,
        )

    @property
    def digest(self) -> str:
        """sha256 of the base checkpoint's weight files (adapters are pinned to it)."""
        if self._digest is None:
            self._digest = model_digest(self.config.model)
        return self._digest

    # -- adapters -------------------------------------------------------------------------------

    def add_adapter(
        self, name: str, path: str | Path, *, owner: str | None = None, expected_base_digest: str | None = None
    ) -> AdapterInfo:
        """Register a PEFT LoRA directory as a new version of ``name``, validated now in the calling
        thread (:meth:`AdapterCatalog.add <lorapage.adapters.catalog.AdapterCatalog.add>`)."""
        version = self.catalog.add(name, path, owner=owner, expected_base_digest=expected_base_digest)
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
        (:meth:`AdapterCatalog.register <lorapage.adapters.catalog.AdapterCatalog.register>`);
        ``created`` False: the content of an existing version, which is returned."""
        version, created = await self.catalog.register(
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

    @asynccontextmanager
    async def _locate_version(self, source: str, digest: str, owner: str | None) -> AsyncIterator[Path]:
        """A version's files from its ``source``, checked against the roots ``owner`` may read
        from (a directory) and verified against its ``digest``."""
        try:
            src = await asyncio.to_thread(parse_source, source, sha256=digest, roots=self.adapter_roots, owner=owner)
        except LorapageError as exc:  # a directory that moved, links out now, or a root dropped
            raise AdapterSourceError(f"adapter source {source} is no longer usable: {exc.message}") from None
        # A directory in place is checked as it is read (the bytes hashed are the bytes loaded);
        # a remote one was checked when it landed in the disk cache.
        async with self.sources.use(src, None if isinstance(src, FileSource) else digest, owner) as path:
            yield path

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
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs (cumulative; ``delta_text`` is the new text).

        Cached prompt prefixes are shared only among one tenant's requests (without ``tenant``:
        the default tenant's), or among the requests that name one ``prefix_group``.
        ``request_id`` must be unique among the requests in flight, whatever their tenant (a
        server makes its own rather than take a client's). Stopping iteration early (a client
        went away) aborts the request and frees its pages. ``progress``, when given, holds the
        prompt tokens computed for it once the generator ends (what a quota charges a request cut
        before its first token).
        """
        self._check_open()
        self.step_loop.bind()
        sampling = sampling or SamplingParams()
        if adapter is not None:
            adapter = self.catalog.resolve_version(adapter)  # this request runs on this version to its end
        merged = self.merged_adapter
        self._check_weights(merged)
        if merged is not None:
            self._check_merged_route(adapter)
            adapter = None  # the weights hold the adapter: the LoRA path would add it twice
        self._check_adapter_tokens(adapter, sampling)
        self.intake.check(adapter, sampling)
        try:
            ids, constraints, bad_words = await asyncio.gather(
                self.intake.prompt_ids(prompt),
                asyncio.gather(*(self.intake.constraint(sampling) for _ in range(sampling.n))),
                self.intake.bad_words_ids(sampling),
            )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                raise EngineClosedError("the engine was closed while the prompt was tokenized") from None
            raise  # the caller's own cancellation
        self._check_open()  # closed while the prompt was tokenized
        self._check_weights(merged)  # the route was decided on the weights as they were before tokenizing

        def build(k: int) -> Request:
            rid = request_id if k == 0 or request_id is None else f"{request_id}-{k}"
            branch = dataclasses.replace(sampling, n=1, seed=None if sampling.seed is None else sampling.seed + k)
            req = self.intake.build(
                ids, adapter, branch, tenant, rid, prefix_group, constraint=constraints[k], bad_words_ids=bad_words
            )
            req.merged_adapter = merged  # charged to the merged version, though it runs on the base path
            return req

        req = build(0)
        self.scheduler.submit(req)
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
                        self.scheduler.submit(requests[j])
                        pumps.append(asyncio.ensure_future(pump(j, requests[j])))
                    self._wake_up()
                done += item.finished
                yield dataclasses.replace(item, index=k)
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
        """One request's final output (:meth:`generate`, its stream read to the end)."""
        last = None
        async for last in self.generate(prompt, adapter, sampling, tenant=tenant):
            pass
        assert last is not None  # a request ends with a finished output, or raises
        return last

    def _check_weights(self, merged: str | None) -> None:
        """Refuse (409) a request that would run while the weights change, or whose route was
        decided before they did (``merged``: the merged version it saw)."""
        if self._merging or self.merged_adapter != merged:
            raise ConflictError("an adapter is being merged into this engine's weights; retry once it is done")

    def _check_merged_route(self, adapter: str | None) -> None:
        """A dedicated deployment serves its merged version (on the plain base path) and nothing else."""
        if adapter == self.merged_adapter:
            return
        merged_id = self.merged_adapter.partition("@")[0] if self.merged_adapter else ""
        asked = "the base model" if adapter is None else f"adapter {adapter!r}"
        raise AdapterNotFoundError(
            f"this server is a dedicated deployment of adapter {merged_id!r} (merged into the base weights): it "
            f"serves only model {merged_id!r}, not {asked}",
            param="model",
        )

    def _check_adapter_tokens(self, adapter: str | None, sampling: SamplingParams) -> None:
        """``max_adapter_tokens``: long generations on an adapter belong to its dedicated tier."""
        limit = self.config.max_adapter_tokens
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
        key = self.catalog.resolve_version(name)
        if self.merged_adapter is not None:
            raise ConflictError(f"this engine already holds {self.merged_adapter!r} merged into its weights")
        if self.scheduler.requests:
            raise ConflictError("requests are in flight: the weights they run on cannot change under them")
        entry = self.adapters.get(key)
        self._merging = True
        try:
            tensors, scales = await self._merge_tensors(key, entry)
            # On the forward thread: ordered with the steps (and graph replays) on its stream.
            await asyncio.get_running_loop().run_in_executor(
                self._forward, merge, self.runner.ctx.model, tensors, scales
            )
            self.intake.weights_changed(entry.cache_id)  # blocks the base cached before are of other weights
            self.merged_adapter = key
        finally:
            self._merging = False
        log.info("adapter %s merged into the base weights: this engine is its dedicated deployment", key)
        return key

    async def _merge_tensors(self, key: str, entry: AdapterEntry) -> tuple[dict, dict[tuple[int, str], float]]:
        """A version's A and B in float32 and its scales, read from its files (as the loader
        does) and checked against its registered digest."""
        loop = asyncio.get_running_loop()
        async with AsyncExitStack() as held:
            spec = entry.spec
            if entry.origin.source:  # a fetched copy, as the loader reads it (lorapage.adapters.loader)
                origin = entry.origin
                spec = at_path(spec, await held.enter_async_context(
                    self._locate_version(origin.source, entry.digest, origin.owner)
                ))  # fmt: skip
            weights = await loop.run_in_executor(self._io, read_weights, spec)
            if entry.digest and await loop.run_in_executor(self._io, content_digest, spec, weights) != entry.digest:
                raise AdapterLoadError(f"adapter {key!r}: its files changed since registration; register it again")
            tensors = await loop.run_in_executor(self._io, load_adapter_tensors, spec, torch.float32, weights)
        return tensors, spec.scales

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages are freed within one step."""
        self.scheduler.abort(request_id)
        self._wake_up()

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """New VTC shares (a reloaded tenants file); FCFS has none."""
        inner = getattr(self.policy, "policy", self.policy)
        if hasattr(inner, "set_tenant_weights"):
            inner.set_tenant_weights(weights)

    def metrics(self) -> EngineMetrics:
        """The live sources ``/metrics`` reads this engine through (stats, scheduler, VTC counters,
        adapters), for :func:`lorapage.server.metrics.register_engine_collectors`."""
        return EngineMetrics(self.stats, self.scheduler_metrics, self._vtc_counters, self.adapter_metrics)

    def record_rejected(self, tenant: str, tokens: int, reason: str) -> None:
        """Count a request a front end refused before it reached the engine (a quota's 429:
        ``reason`` names which) against ``tenant``, with its ``tokens`` when known (else 0)."""
        self.scheduler_metrics.record_rejected(tenant, tokens, reason)

    def _vtc_counters(self) -> dict[str, float]:
        """Each tenant's VTC virtual counter now (none under FCFS), as ``/metrics`` exports them."""
        inner = self.policy.policy if isinstance(self.policy, MeteredPolicy) else self.policy
        return inner.counters() if isinstance(inner, VtcScheduler) else {}

    def usage_rows(
        self, *, tenants: set[str] | None = None, adapters: set[str] | None = None, since_hour: int | None = None
    ) -> list[tuple[tuple[int, str, str], Usage]]:
        """Cost attribution, ``((hour, tenant, adapter), usage)`` in order (see
        :mod:`lorapage.usage.ledger`), residency charged up to now; hours use the engine's clock."""
        now = self.clock()
        self.usage.record_residency(now, self.adapters.resident_pages())
        self.usage.prune(now)
        return self.usage.query(tenants=tenants, adapters=adapters, since_hour=since_hour)

    def _wall_clock(self) -> float:
        """Unix seconds by the engine's clock: the hours traffic and usage are counted in."""
        return self.clock() + self.usage.wall_offset

    def pool_free_pages(self) -> int:
        """Pages free for new work: free ones, and cached KV blocks nobody holds (given back by
        value per page, with idle adapters)."""
        return self.pool.num_free + self.prefix_cache.num_idle

    def _held_adapter_pages(self) -> int:
        """Pool pages of resident adapters that cannot be evicted now: pinned, kept hot, or with
        requests queued or running."""
        rules = self.residency
        return sum(
            pages
            for key, pages in rules.resident_pages().items()
            if (r := rules.adapters[key]).pinned or r.hot or r.running or r.waiting
        )

    def stats(self) -> EngineStats:
        """Resident and host-RAM adapters, queue depth, running sequences, pool use, evictions."""
        now = self.clock()
        hits, queried = self.scheduler.prefix_hit_tokens, self.scheduler.prefix_query_tokens
        resident, in_host = tuple(self.adapters.resident()), tuple(self.adapters.in_host())
        prefetches = self.residency.prefetch.counts
        costs = self.adapters.costs
        return EngineStats(
            resident_adapters=resident,
            host_ram_adapters=in_host,
            host_ram_adapter_bytes=self.residency.host_bytes(),
            lora_slots=self.max_resident_loras,
            registered_adapters=len(self.adapters.entries),
            adapter_yields=self.residency.yields,
            adapters_pinned=len(self.residency.pinned()),
            adapters_resident=len(resident),
            adapters_host_ram=len(in_host),
            adapters_kept_hot=len(self.residency.hot()),
            adapter_pinned_pages=self.adapters.pinned_pages(),
            adapter_pin_limit_pages=self.adapters.pin_limit(),
            adapter_prefetches_started=prefetches["started"],
            adapter_prefetches_done=prefetches["done"],
            adapter_prefetches_failed=prefetches["failed"],
            adapter_prefetches_dropped=prefetches["dropped"],
            adapter_copy_s_per_page=costs.seconds_per_page(Stage.COPY),
            adapter_read_s_per_page=costs.seconds_per_page(Stage.READ),
            adapter_download_s_per_page=costs.seconds_per_page(Stage.DOWNLOAD),
            queue_depth=self.policy.num_waiting(),
            running=len(self.scheduler.running),
            running_by_tenant=_running_by_tenant(self.scheduler.running, self.scheduler_metrics.tenants),
            preemptions=self.scheduler.num_preemptions,
            kv_pages_held_by_tenant=_kv_pages_by_tenant(self.scheduler.running, self.scheduler_metrics.tenants),
            pool_pages_total=self.pool.capacity,
            pool_pages_kv=self.pool.used[PageKind.KV] - self.prefix_cache.num_idle,
            pool_pages_adapters=self.pool.used[PageKind.ADAPTER],
            pool_pages_free=self.pool_free_pages(),
            pool_pages_cached=self.prefix_cache.num_cached,
            pool_pages_cached_idle=self.prefix_cache.num_idle,
            prefix_cache_evicted_blocks=self.prefix_cache.evicted,
            prefix_cache_hit_rate=_ratio(sum(hits.values()), sum(queried.values())),
            prefix_cache_hit_rate_by_tenant={t: _ratio(hits[t], n) for t, n in queried.items()},
            evictions_per_minute=sum(1 for t in self.residency.evictions if now - t <= 60.0),
            adapter_held_pages=self._held_adapter_pages(),
            pool_page_bytes=self.page_bytes,
            tokens_in_flight=sum(
                r.num_prompt_tokens + max(r.max_tokens - len(r.output_ids), 0) for r in self.scheduler.requests.values()
            ),
            merged_deployment=self.merge_check,
        )

    async def close(self) -> None:
        """Abort everything in flight and stop the step loop and worker threads."""
        self._closed = True
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid)
        self._wake_up()
        await self.step_loop.stop()
        try:  # wait, without blocking the loop, for the step in flight and any queued copies
            await asyncio.wrap_future(self._forward.submit(lambda: None))
        except RuntimeError:  # closed before: the forward thread is gone already
            pass
        self._forward.shutdown(wait=True)  # idle by now: returns at once
        # Requests aborted while a step was in flight waited for that step's results, which the
        # cancelled loop will never apply: finish them now that the forward thread is idle.
        self.scheduler.abort_all_after_close()
        try:  # the traffic counted since the last write, before the registry closes
            await self.tiers.stop()
        except Exception:
            log.exception("traffic tiers: the last traffic counts could not be written")
        self._io.shutdown(wait=False, cancel_futures=True)
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        self._grammar_thread.shutdown(wait=False, cancel_futures=True)
        self.runner.close()
        if self._copies is not None:
            self._copies.shutdown(wait=False, cancel_futures=True)
        await self.sources.close()
        self.catalog.close()  # waits for a commit in flight (the registry's lock)
        if self._state_lock is not None:
            self._state_lock.release()  # the state dir is another server's to take from here

    # -- internals ------------------------------------------------------------------------------

    def _on_new_loop(self) -> None:
        """The step loop starts on an event loop: adapter loads restart there, and so do the tiers' re-evaluations."""
        self.adapters.rebind_loop()
        self.tiers.start()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine has been closed")

    def _wake_up(self) -> None:
        self.step_loop.wake()

    async def _run_on_device(self, fn: Callable[[], None]) -> None:
        """Run an adapter's copy into its pages. On CUDA it queues on the forward thread, ordered
        with the steps on one stream (and between graph replays). On a CPU there is no stream, and
        the copy writes only pages and a slot reserved for its load, which no step reads until
        the load is done. So it runs on the copy thread beside the step in flight rather than
        behind it, which would add up to a whole step to every cold request's wait."""
        executor = self._copies or self._forward
        await asyncio.get_running_loop().run_in_executor(executor, fn)


def _running_by_tenant(running: list[Request], seen: Iterable[str]) -> dict[str, int]:
    """Sequences in the batch per tenant; every tenant in ``seen`` is reported, at 0 when it has none."""
    count = dict.fromkeys(seen, 0)
    for req in running:
        count[req.tenant] = count.get(req.tenant, 0) + 1
    return count


def _kv_pages_by_tenant(running: list[Request], seen: Iterable[str]) -> dict[str, int]:
    """KV blocks in the block tables of each tenant's running requests (a cached block several
    share counts for each); every tenant in ``seen`` is reported, at 0 when it holds none."""
    held = dict.fromkeys(seen, 0)
    for req in running:
        held[req.tenant] = held.get(req.tenant, 0) + len(req.block_table)
    return held


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _base_names(config: EngineConfig) -> dict[str, str]:
    """The base-names table ``config.base_names`` names (none: empty); ValueError naming the file."""
    if config.base_names is None:
        return {}
    try:
        return load_base_names(config.base_names)
    except ValueError as exc:
        raise ValueError(f"EngineConfig.base_names {config.base_names}: {exc}") from None

"""How an :class:`~lorapage.engine.engine.Engine` is put together: named builders, in the order
they run, each returning a frozen bundle of parts made from the one :class:`EngineConfig`
(and the few runtime inputs: the clock, the adapter roots, the tenants' weights).

``base -> sizing -> model weights -> memory -> forward -> threads -> adapters -> catalog (and
the traffic tiers) -> scheduling -> admin``. A part is handed only what was built before it;
where an earlier part must reach a later one, the link is an explicit callback made first (the
step loop's :class:`Wakeup`, the engine's ``check_open``) or set by the later builder (the
adapter metrics' projected costs).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from lorapage.adapters.binding import BaseBinding, BaseNames, load_base_names
from lorapage.adapters.cache import AdapterCache
from lorapage.adapters.envelope import Envelope
from lorapage.adapters.layout import max_adapter_pages
from lorapage.adapters.loader import AdapterLoader, RankShards
from lorapage.adapters.metrics import AdapterMetrics
from lorapage.adapters.pins import PinBounds
from lorapage.adapters.residency import Residency, ResidencyLimits
from lorapage.adapters.value import ReloadCosts
from lorapage.adapters.variant_layout import page_list_width
from lorapage.config import MAX_DERIVED_LORA_SLOTS, EngineConfig
from lorapage.engine.devices import DTYPES, Threads, forward_thread_count, resolve_device, wants_lora_side
from lorapage.engine.intake import RequestIntake
from lorapage.engine.step_loop import StepLoop, Wakeup
from lorapage.engine.step_planner import StepLimits, StepPlanner
from lorapage.engine.tiering import TierKeeper
from lorapage.kernels.backend import KernelOps, select_backend
from lorapage.kernels.lora_side import LoraSide
from lorapage.memory.pool import PagePool, adapter_page_size, kv_page_elements
from lorapage.memory.prefix_cache import PrefixCache
from lorapage.memory.reclaim import Reclaim, RecomputeCost
from lorapage.memory.sizing import POOL_HEADROOM_BYTES, lora_slots, pages_for_memory, step_activation_bytes
from lorapage.model.config import ModelConfig, context_length
from lorapage.model.gemma import GemmaModel
from lorapage.model.llama import LlamaModel, lora_h_width
from lorapage.model.loader import model_digest
from lorapage.model.lora_tables import LoraTables
from lorapage.model.merge import module_weight
from lorapage.model.quantized_checkpoint import load_checkpoint, quantized_base
from lorapage.model.quantized_ops import quantized_ops
from lorapage.model.runner import ModelRunner
from lorapage.model.tokenizer import Tokenizer
from lorapage.parallel import TensorParallelGroup, check_tensor_parallel, shard_config
from lorapage.parallel.shards import shard_base
from lorapage.parallel.wire import WorkerSpec
from lorapage.request import Request
from lorapage.scheduler import SchedulerMetrics, SchedulerPolicy, VtcConfig, make_policy
from lorapage.sources import ANYWHERE, AdapterRoots, AdapterSources, DownloadLimits
from lorapage.sources.version_files import VersionFiles
from lorapage.structured.grammars import GrammarCompiler
from lorapage.usage import UsageLedger

CPU_POOL_BYTES = 4 << 30  # auto-sized pools on CPU stay under this
MAX_PREFETCHES = 2  # prefetches into host RAM use at most this many I/O threads (and always leave one)

log = logging.getLogger("lorapage.engine")


# -- the base ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseParts:
    """The base checkpoint as read from its directory: its config, tokenizer and names."""

    model_dir: Path
    name: str  # the directory's name: how requests, metrics and the fleet name this base
    model_config: ModelConfig
    tokenizer: Tokenizer
    binding: BaseBinding  # how registration tells the base an adapter was trained on
    eos_token_ids: frozenset[int]
    digest: Callable[[], str]  # sha256 of the weight files, computed when first asked


def build_base(config: EngineConfig) -> BaseParts:
    model_dir = Path(config.model)
    mc = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = mc.eos_token_ids or (tokenizer.eos_token_id,)
    return BaseParts(
        model_dir=model_dir,
        name=model_dir.name,
        model_config=mc,
        tokenizer=tokenizer,
        binding=BaseBinding(BaseNames.of_base(model_dir, _base_names(config)), config.allow_unbound),
        eos_token_ids=frozenset(t for t in eos if t is not None),
        digest=functools.cache(functools.partial(model_digest, config.model)),
    )


def _base_names(config: EngineConfig) -> dict[str, str]:
    """The base-names table ``config.base_names`` names (none: empty); ValueError naming the file."""
    if config.base_names is None:
        return {}
    try:
        return load_base_names(config.base_names)
    except ValueError as exc:
        raise ValueError(f"EngineConfig.base_names {config.base_names}: {exc}") from None


# -- sizing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizing:
    """The device, dtypes and sizes every other part is made to."""

    device: torch.device
    dtype: torch.dtype
    lora_dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV pages' (kv_cache_dtype)
    block_size: int
    page_size: int  # elements (dtype) of one pool page in one layer: a KV block's K and V in kv_dtype
    adapter_pages: int  # pool pages the largest adapter takes
    max_blocks: int  # KV blocks of the longest sequence
    max_model_len: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    shard_model: ModelConfig  # what one tensor-parallel rank holds (the base's config when there is one rank)


def build_sizing(config: EngineConfig, base: BaseParts) -> Sizing:
    """The sizes, checked: ValueError naming the fields when a step could never hold its work."""
    bs, tp = config.block_size, config.tensor_parallel_size
    check_tensor_parallel(base.model_config, tp)
    device = resolve_device(config.device)
    # A rank's pool pages hold its KV heads and its shard of each adapter: sized from its shard.
    mc = shard_config(base.model_config, tp)
    dtype, lora_dtype = DTYPES[config.dtype], DTYPES[config.resolved_lora_dtype]
    kv_dtype, int8 = DTYPES[config.kv_dtype_name], lora_dtype == torch.int8
    page_size = kv_page_elements(bs, mc.kv_size, dtype, kv_dtype)
    max_model_len = context_length(mc, config.max_model_len, config.allow_long_max_model_len)
    tokens = config.max_num_batched_tokens or max(2048, max_model_len)
    if tokens < max_model_len and not config.enable_chunked_prefill:
        # Without chunked prefill a whole prompt (or a preempted sequence's recompute) must fit in one step.
        raise ValueError(
            f"max_num_batched_tokens ({tokens}) must be >= "
            f"max_model_len ({max_model_len}) unless enable_chunked_prefill is on"
        )
    if tokens < config.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({tokens}) must be >= max_num_seqs "
            f"({config.max_num_seqs}): every running sequence decodes one token per step"
        )
    return Sizing(
        device=device,
        dtype=dtype,
        lora_dtype=lora_dtype,
        kv_dtype=kv_dtype,
        block_size=bs,
        page_size=page_size,
        adapter_pages=max_adapter_pages(  # a page holds more adapter elements when adapters are narrower than KV
            mc, config.max_lora_rank, adapter_page_size(page_size, dtype, lora_dtype), int8
        ),
        max_blocks=-(-max_model_len // bs),
        max_model_len=max_model_len,
        max_num_batched_tokens=tokens,
        tensor_parallel_size=tp,
        shard_model=mc,
    )


def load_model(base: BaseParts, sizing: Sizing) -> LlamaModel:
    """The base's weights on the device: loaded before the pool, which on CUDA is sized from what they leave."""
    state, scales = load_checkpoint(base.model_dir, sizing.dtype, base.model_config)
    weights = shard_base(state, 0, sizing.tensor_parallel_size, base.model_config)
    arch = GemmaModel if base.model_config.gemma is not None else LlamaModel
    return quantized_base(arch(sizing.shard_model, weights, sizing.device, sizing.dtype, sizing.max_model_len), scales)


# -- memory ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryParts:
    """The page pool (KV blocks, adapter pages), adapter tables, prefix cache, and Reclaim's ranking."""

    pool: PagePool
    tables: LoraTables
    prefix_cache: PrefixCache
    recompute: RecomputeCost  # fed measured prefill timings by the step loop
    reclaim: Reclaim
    max_resident_loras: int  # lora slots: adapters resident at once (max_loras is per batch)
    page_bytes: int  # one pool page across every layer
    step_reserve_bytes: int  # what a CUDA pool left beside it for the steps (0 elsewhere)


def build_memory(config: EngineConfig, base: BaseParts, sizing: Sizing, clock: Callable[[], float]) -> MemoryParts:
    mc = base.model_config
    num_pages, reserve = _num_pages(config, mc, sizing)
    pool = PagePool(
        mc.num_layers, num_pages, sizing.page_size, sizing.dtype, sizing.device, sizing.lora_dtype, sizing.kv_dtype
    )
    slots = lora_slots(
        config.max_loras, config.max_resident_loras, pool.capacity, sizing.adapter_pages, MAX_DERIVED_LORA_SLOTS
    )
    prefix_cache = PrefixCache(pool, clock)
    list_width = page_list_width(sizing.shard_model, config.max_lora_rank, pool.adapter_page_size)
    page_bytes = mc.num_layers * sizing.page_size * pool.storage.element_size()
    recompute = RecomputeCost(page_bytes, sizing.block_size)
    return MemoryParts(
        pool=pool,
        tables=LoraTables(sizing.shard_model, slots, list_width, sizing.device),
        prefix_cache=prefix_cache,
        recompute=recompute,
        reclaim=Reclaim(pool, prefix_cache, recompute),
        max_resident_loras=slots,
        page_bytes=page_bytes,
        step_reserve_bytes=reserve,
    )


def _num_pages(config: EngineConfig, mc: ModelConfig, sizing: Sizing) -> tuple[int, int]:
    """The pool's pages, and the bytes a CUDA pool leaves beside it for the steps (activations,
    headroom: allocated as steps run; an engine sized after it on the device leaves them)."""
    if config.num_pages is not None:
        return config.num_pages, 0
    # Room for the adapters asked to be resident at once (an explicit max_resident_loras), else for
    # one batch's (max_loras); a derived max_resident_loras then follows the pool (lora_slots).
    adapters = config.max_resident_loras or config.max_loras
    want = 1 + config.max_num_seqs * sizing.max_blocks + adapters * sizing.adapter_pages
    elem = torch.finfo(sizing.dtype).bits // 8
    per_page = mc.num_layers * sizing.page_size * elem
    if sizing.device.type != "cuda":
        return min(want, CPU_POOL_BYTES // per_page), 0
    free, total = torch.cuda.mem_get_info(sizing.device)
    activations = step_activation_bytes(
        sizing.max_num_batched_tokens,
        config.max_num_seqs,
        mc.hidden_size,
        mc.q_size + 2 * mc.kv_size,
        mc.intermediate_size,
        mc.vocab_size,
        elem,
    )
    pages = pages_for_memory(
        want,
        per_page,
        total=total,
        free=free,
        utilization=config.gpu_memory_utilization,
        activations=activations,
        headroom=POOL_HEADROOM_BYTES,
    )
    return pages, activations + POOL_HEADROOM_BYTES


# -- the forward pass --------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardParts:
    """The kernels chosen for the device and the model runner (with its CUDA graphs captured)."""

    ops: KernelOps
    runner: ModelRunner
    parallel: TensorParallelGroup | None  # the other tensor-parallel ranks (None: one device)


def build_forward(
    config: EngineConfig, base: BaseParts, sizing: Sizing, model: LlamaModel, memory: MemoryParts
) -> ForwardParts:
    ops = select_backend(config.kernel_backend, sizing.device, sizing.dtype, sizing.lora_dtype)
    ops = quantized_ops(ops, config.quantization, sizing.device, base.model_config, config.quantize_lm_head)
    side = wants_lora_side(config.lora_side_thread, sizing.device, config.num_threads, sizing.tensor_parallel_size)
    if side and ops.lora_group is not None:  # LoRA beside the projections (kernels/lora_side.py)
        ops = dataclasses.replace(ops, lora_side=LoraSide())
    runner = ModelRunner(
        model,
        memory.pool,
        memory.tables,
        ops,
        sizing.block_size,
        config.max_num_seqs,
        sizing.max_num_batched_tokens,
        sizing.max_blocks,
        lora_h_width(base.model_config, config.max_lora_rank),
    )
    parallel = _start_ranks(config, base, sizing, memory) if sizing.tensor_parallel_size > 1 else None
    if parallel is not None:  # every rank captures its graphs (collectives inside) at once
        model.comm = parallel.comm
        runner.send_step, runner.on_close = parallel.send_step, parallel.close
        runner.send_capture = parallel.send_capture
    # A MoE base's routing varies its shapes per step (model/moe.py): it runs eagerly.
    graphs = ops.captures_graphs and base.model_config.moe is None
    if sizing.device.type == "cuda" and graphs and not config.enforce_eager:
        try:
            with torch.cuda.device(sizing.device):
                runner.capture_decode_graphs(config.max_num_seqs)
        except BaseException:
            runner.close()  # the worker ranks with it
            raise
    return ForwardParts(ops, runner, parallel)


def _start_ranks(config: EngineConfig, base: BaseParts, sizing: Sizing, memory: MemoryParts) -> TensorParallelGroup:
    """The worker ranks, each building the pool and tables rank 0 built, at its shard's sizes."""
    tp = sizing.tensor_parallel_size
    threads = forward_thread_count(config.num_threads, sizing.device)
    spec = WorkerSpec(
        model_dir=str(base.model_dir), world_size=tp, timeout_s=config.tensor_parallel_timeout_s,
        device=str(sizing.device), dtype=sizing.dtype, lora_dtype=sizing.lora_dtype,
        kernel_backend=config.kernel_backend,
        threads=max(1, threads // tp) if sizing.device.type == "cpu" else threads,
        max_model_len=sizing.max_model_len, block_size=sizing.block_size, page_size=sizing.page_size,
        num_pages=memory.pool.storage.shape[1], lora_slots=memory.max_resident_loras,
        page_list_width=memory.tables.page_table.shape[1], max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=sizing.max_num_batched_tokens, max_blocks=sizing.max_blocks,
        lora_h_width=lora_h_width(base.model_config, config.max_lora_rank),
        quantization=config.quantization, quantize_lm_head=config.quantize_lm_head,
    )  # fmt: skip
    return TensorParallelGroup(spec)


# -- adapters ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterParts:
    """The adapters' residency rules and the cache that applies them, where their files come
    from, and their usage and traffic (the registry and the tiers are the catalog's: :func:`build_catalog`)."""

    residency: Residency
    cache: AdapterCache  # registered versions and their loads
    sources: AdapterSources
    files: VersionFiles
    sources_cache_dir: str | None  # where remote versions land on disk
    usage: UsageLedger  # cost attribution, hours of the calendar
    metrics: AdapterMetrics
    roots: AdapterRoots
    wall_clock: Callable[[], float]  # Unix seconds by the engine's clock: the hours traffic and usage are counted in


def build_adapters(
    config: EngineConfig,
    base: BaseParts,
    sizing: Sizing,
    memory: MemoryParts,
    threads: Threads,
    clock: Callable[[], float],
    roots: AdapterRoots | None,
    on_ready: Callable[[], None],
    model: LlamaModel,
    ranks: RankShards | None = None,
) -> AdapterParts:
    """``on_ready``: wakes the step loop when a load is done; ``ranks``: the other tensor-parallel
    ranks, sent their shard of each load."""
    roots = roots if roots is not None else ANYWHERE
    mc, pool = base.model_config, memory.pool
    costs = ReloadCosts(memory.page_bytes)
    residency = Residency(
        ResidencyLimits(
            max_resident_loras=memory.max_resident_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_cpu_lora_bytes=config.max_cpu_lora_bytes,
            adapter_wait_s=config.adapter_wait_s,
            max_prefetches=max(0, min(MAX_PREFETCHES, threads.io_threads - 1)),
            pins=PinBounds(
                pool.capacity,
                memory.max_resident_loras,
                config.max_pinned_fraction,
                sequence_pages=sizing.max_blocks,
                max_adapter_pages=sizing.adapter_pages,
            ),
        ),
        pool,
        memory.reclaim,
        costs,
    )
    cache_dir = config.adapter_cache_dir or (
        str(Path(config.state_dir) / "adapter-cache") if config.state_dir is not None else None
    )
    sources = AdapterSources(
        Path(cache_dir) if cache_dir is not None else None,
        config.adapter_cache_bytes,
        limits=DownloadLimits(
            config.max_adapter_download_bytes,
            timeout_s=config.adapter_download_timeout_s,
            min_bytes_per_s=config.min_adapter_download_bytes_per_s,
            allow_private=config.allow_private_adapter_sources,
        ),
        adapter_roots=roots,
        executor=threads.io,
        s3_endpoint_url=config.s3_endpoint_url,
        hf_endpoint=config.hf_endpoint,
    )
    files = VersionFiles(roots, sources)
    usage = UsageLedger(wall_offset=time.time() - clock())  # hours of the calendar

    def wall_clock() -> float:
        return clock() + usage.wall_offset

    metrics = AdapterMetrics(  # projected costs are the catalog's (build_catalog)
        config.metrics_top_adapters,
        usage=usage,
        bytes_downloaded=lambda: sources.stats().bytes_downloaded,
        pinned_pages=residency.pins.pinned_pages,
    )
    loader = AdapterLoader(
        pool,
        memory.tables,
        sizing.dtype if sizing.lora_dtype == torch.int8 else sizing.lora_dtype,  # int8: quantized as packed
        costs,
        io_executor=threads.io,
        run_on_device=threads.run_on_device,
        locate=files.locate,
        base_weight=functools.partial(module_weight, model) if ranks is None else ranks.base_weight,
        ranks=ranks,
    )
    cache = AdapterCache(
        mc,
        pool,
        residency,
        loader,
        max_lora_rank=config.max_lora_rank,
        envelope=Envelope.from_config(config, mc, sizing.dtype.itemsize, sizing.lora_dtype.itemsize),
        on_ready=on_ready,
        clock=clock,
        sequence_pages=sizing.max_blocks,
        metrics=metrics,
        landed=sources.cached,
        layout_model=sizing.shard_model,
    )
    return AdapterParts(residency, cache, sources, files, cache_dir, usage, metrics, roots, wall_clock)


# -- scheduling --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SchedulingParts:
    """Who runs next: the admission policy (VTC or FCFS), the step planner (room, preemption,
    results), the step loop that drives it, and the intake that turns calls into requests."""

    metrics: SchedulerMetrics
    policy: SchedulerPolicy[Request]
    planner: StepPlanner
    step_loop: StepLoop
    grammars: GrammarCompiler
    intake: RequestIntake


def build_scheduling(
    config: EngineConfig,
    base: BaseParts,
    sizing: Sizing,
    memory: MemoryParts,
    forward: ForwardParts,
    threads: Threads,
    adapters: AdapterParts,
    tiers: TierKeeper,
    wakeup: Wakeup,
    clock: Callable[[], float],
    tenant_weights: Mapping[str, float] | None,
) -> SchedulingParts:
    """``wakeup``: the step loop's wake-up, made before the adapters (their loads ring it)."""
    metrics = SchedulerMetrics()
    policy: SchedulerPolicy[Request] = make_policy(
        config.scheduler,
        vtc=VtcConfig(
            max_loras=config.max_loras,
            reserved_tail_lanes=config.reserved_tail_lanes,
            age_deadline_s=config.lane_age_deadline_s,
            lend_max_tokens=config.lane_lend_max_tokens,
        ),
        tenant_weights=tenant_weights,
        metrics=metrics,
    )
    limits = StepLimits(
        sizing.block_size,
        config.max_num_seqs,
        sizing.max_num_batched_tokens,
        sizing.max_model_len,
        base.eos_token_ids,
        chunked_prefill=config.enable_chunked_prefill,
        layer_windows=base.model_config.layer_windows,
        num_scheduler_steps=config.num_scheduler_steps,
    )
    planner = StepPlanner(
        policy,
        adapters.cache,
        memory.pool,
        limits,
        clock,
        metrics=metrics,
        prefix_cache=memory.prefix_cache,
        usage=adapters.usage,
    )

    def on_new_loop() -> None:
        """The step loop starts on an event loop: adapter loads restart there, and so do the tiers' re-evaluations."""
        adapters.cache.rebind_loop()
        tiers.start()

    step_loop = StepLoop(
        planner, forward.runner, threads.forward, wakeup, on_new_loop=on_new_loop, on_prefill=memory.recompute.observe
    )
    grammars = _grammars(base, threads)
    intake = RequestIntake(
        tokenizer=base.tokenizer,
        vocab_size=base.model_config.vocab_size,
        max_model_len=sizing.max_model_len,
        block_size=sizing.block_size,
        max_queue_len=config.max_queue_len,
        pool=memory.pool,
        adapters=adapters.cache,
        num_waiting=policy.num_waiting,
        in_flight=planner.requests.keys(),
        tokenize=threads.tokenize,
        clock=clock,
        eos_token_ids=base.eos_token_ids,
        grammars=grammars,
        # The cache lives as long as this engine, on one base: its name suffices to tell it apart.
        prefix_namespace=f"base|{base.name}".encode() if config.enable_prefix_caching else None,
    )
    return SchedulingParts(metrics, policy, planner, step_loop, grammars, intake)


def _grammars(base: BaseParts, threads: Threads) -> GrammarCompiler:
    """Structured output's compiler. The grammar engine knows the tokenizer's tokens only: an EOS id
    past them (a config whose vocabulary is padded beyond the tokenizer's) is left to the engine's
    own stop check."""
    tokenizer = base.tokenizer
    known = tokenizer.backend.get_vocab_size(with_added_tokens=True)
    grammar_eos = tuple(sorted(t for t in base.eos_token_ids if t < known))
    if not grammar_eos and tokenizer.eos_token_id is not None:
        grammar_eos = (tokenizer.eos_token_id,)
    return GrammarCompiler(tokenizer.backend.to_str(), base.model_config.vocab_size, grammar_eos, threads.grammar)

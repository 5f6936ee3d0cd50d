"""Frozen engine configuration, with vLLM-familiar names."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from lorapage.kernels.names import BACKENDS
from lorapage.options import bounds_error, option

TINY_MODEL_DIR = Path(__file__).parent / "assets" / "tiny"
DEFAULT_TENANT = "default"  # the embedded engine's tenant when a request names none

# The values EngineConfig accepts for its option fields (the CLI offers the same).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
LORA_DTYPE_NAMES = ("auto", *DTYPE_NAMES, "int8")  # auto: the model's dtype; int8: with per-row scales
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # vLLM's
# Per model dtype, the narrower ones adapters may take.
NARROW_LORA_DTYPES = {"float32": ("bfloat16", "float16", "int8")}
# vLLM's kv_cache_dtype names (and their long forms) -> the pages' dtype; auto: the model's.
KV_CACHE_DTYPES = {"auto": None, "fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
QUANTIZATIONS = ("int8", "w8a8", "fp8")  # vLLM's --quantization names lorapage has (None: the weights in dtype)
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")  # accepted names, refused with a reason
KERNEL_BACKENDS = BACKENDS  # defined beside the kernels, which know nothing of this config
SCHEDULERS = ("fcfs", "vtc")
# vLLM's --tool-call-parser names lorapage has (lorapage.tools.families); auto: the chat template's.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic")
REASONING_PARSERS = ("none", "qwen3")  # vLLM's --reasoning-parser names lorapage has
# The most lora slots a derived max_resident_loras takes (an explicit one may be more).
MAX_DERIVED_LORA_SLOTS = 1024
# The module classes a shared-envelope rule names (lorapage.adapters.envelope maps them to modules).
ENVELOPE_MODULE_CLASSES = ("attention", "mlp", "all")
# The envelope where a dedicated tier takes the wider adapters (lorapage fleet, its capacity plan),
# unless one is given; on one machine, with no dedicated tier, it follows max_lora_rank instead.
FLEET_ENVELOPE = "all:16"


@dataclass(frozen=True)
class EngineConfig:
    """Everything fixed when an :class:`~lorapage.Engine` starts.

    Memory: one pool of ``num_pages`` pages (``None``: sized from ``max_num_seqs``,
    ``max_model_len`` and ``max_resident_loras``, else ``max_loras``, adapters of ``max_lora_rank``
    on every module) holds KV blocks of ``block_size`` tokens and resident adapters alike.

    Adapters: two counts. ``max_loras`` is vLLM's: the distinct adapters one step's batch may hold
    (decode reads each once per step). ``max_resident_loras`` is the lora slots: adapters resident
    in the pool at once, bounded by the pool's pages too; it may be far larger ("250 resident, at
    most 32 in one batch").

    Each field is declared once, with its help and its concern (:func:`option`): the command-line
    flags of ``lorapage serve``, ``fleet`` and ``replay run --embedded`` are made from these
    declarations (:mod:`lorapage.flags`).
    """

    # -- model ----------------------------------------------------------------------------------
    model: str = option(
        str(TINY_MODEL_DIR / "base"), "Hugging Face model directory", group="model", shown="the built-in tiny model"
    )
    dtype: str = option("float32", "the model's dtype", group="model", choices=DTYPE_NAMES)
    lora_dtype: str = option(
        "auto",
        "the dtype adapter weights are kept in, in the pool and in host RAM (vLLM's lora_dtype); auto: the "
        "model's. bfloat16 under a float32 model halves every adapter's bytes (twice the adapters per page "
        "budget, half the bytes a step reads per adapter) at bfloat16's rounding of each weight; int8 quarters "
        "them: each matrix quantized at load, symmetric, one float32 scale per rank row (the C kernels and the "
        "torch backend; not triton, tensor parallelism, MoE bases or DoRA / lora_bias / embedding LoRA). The "
        "LoRA ops still compute in the model's dtype. Under a 16-bit model: that model's dtype only",
        group="model",
        choices=LORA_DTYPE_NAMES,
    )
    quantization: str | None = option(
        None,
        "the base's weights quantized at load (vLLM's --quantization): int8 is weight-only, per output channel, "
        "symmetric, on a CPU through torch's int8 GEMM (bfloat16 activations into it); w8a8 keeps the same "
        "int8 weights and quantizes the activations to int8 per token at run time (dynamic, symmetric: "
        "llama.cpp Q8_0's and vLLM's W8A8-int8 arithmetic) for an int8 x int8 GEMM; fp8 is e4m3 weight-only per "
        "output channel, for CUDA (on a CPU a slow correctness path); the LoRA ops, attention and logits stay in "
        "the model's dtype (lm_head: see quantize_lm_head). A pre-quantized (compressed-tensors) checkpoint is "
        "detected: none serves it as it is quantized (docs/kernels.md)",
        group="model",
        choices=QUANTIZATIONS,
        none="none: the weights in --dtype",
    )
    quantize_lm_head: bool = option(
        False,
        "the logits' lm_head quantized as the projections are (quantization int8 or w8a8): llama.cpp's Q8_0 "
        "quantizes its output matrix too; off, lm_head stays in --dtype (vLLM's default)",
        group="model",
    )
    device: str = option("auto", "auto | cpu | cuda | cuda:N", group="model")
    tensor_parallel_size: int = option(
        1,
        "ranks the base, the KV pages and every resident adapter are split over (vLLM's name): this process is "
        "rank 0 and starts the others (gloo on a CPU, NCCL on CUDA: cuda:0..N-1); dense bases (Llama, Mistral, "
        "Qwen2/3, Phi-3, Gemma 2/3; not MoE), CUDA graphs off (docs/parallel.md)",
        group="model",
        at_least=1,
    )
    tensor_parallel_timeout_s: float = option(
        60.0,
        "a tensor-parallel collective waiting longer than this fails the engine (a rank that died mid-step); "
        "a dead rank process is seen before the next step without waiting",
        group="model",
        above=0,
    )
    logprobs_mode: str = option(
        "raw_logprobs",
        "what reported logprobs describe where a request does not say (vLLM's logprobs_mode): the model's "
        "(raw) or the distribution each token was drawn from, after the request's processors, temperature, "
        "top-k, min-p and top-p (processed); as logprobs or as logits",
        group="model",
        choices=LOGPROBS_MODES,
    )
    max_model_len: int | None = option(
        None,
        "the longest sequence (prompt + output) in tokens; at most the model's context (max_position_embeddings) "
        "unless allow_long_max_model_len",
        group="model",
        none="the model's context, <= 8192",
        at_least=1,
    )
    allow_long_max_model_len: bool = option(
        False,
        "accept a max_model_len beyond the model's context (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN): positions past "
        "what it was trained on may give wrong outputs",
        group="model",
    )
    tool_call_parser: str = option(
        "auto",
        "how the model writes tool calls, as vLLM's --tool-call-parser names it: what tool_choice auto parses "
        "from its output and what required / a named function constrains it to; auto: the format its chat "
        "template shows (docs/families.md: qwen3_coder for Qwen3-Coder, mistral, pythonic for Llama 3.2 / 4 "
        "pythonic templates and Gemma, llama3_json for Llama 3.1, else hermes: Qwen 2.5 / 3, Hermes)",
        group="model",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str = option(
        "none",
        "as vLLM's --reasoning-parser: qwen3 moves the <think>...</think> a Qwen3 model writes before its answer "
        "into the message's reasoning_content (streamed too); none leaves it in content",
        group="model",
        choices=REASONING_PARSERS,
    )
    # -- memory ---------------------------------------------------------------------------------
    block_size: int = option(16, "tokens per KV block (one page)", group="memory", at_least=1)
    kv_cache_dtype: str = option(
        "auto",
        "the dtype K and V are kept in, in the pool's pages (vLLM's kv_cache_dtype); auto: the model's. fp16 / "
        "bf16 under a float32 model halve a page's bytes (twice the tokens per pool budget, half the KV bytes a "
        "step reads) at that dtype's rounding of each K and V value; attention still computes in float32",
        group="memory",
        choices=(*KV_CACHE_DTYPES, *FP8_KV_CACHE_DTYPES),
    )
    num_pages: int | None = option(
        None,
        "pages in the one pool of KV blocks and adapter weights",
        group="memory",
        none="sized for max_num_seqs full-length sequences and max_resident_loras (if given, else max_loras) "
        "adapters of max_lora_rank, within gpu_memory_utilization on CUDA and 4 GiB on a CPU",
    )
    gpu_memory_utilization: float = option(
        0.9,
        "on CUDA an auto-sized pool stops where the device would pass this fraction of its memory, counting "
        "the weights and one step's activations (as vLLM's); an explicit --num-pages is taken as given",
        group="memory",
        above=0,
        at_most=1,
    )
    # -- scheduling -----------------------------------------------------------------------------
    max_num_seqs: int = option(64, "sequences running at once (rows of a decode step)", group="scheduling", at_least=1)
    max_num_batched_tokens: int | None = option(
        None, "tokens one step computes", group="scheduling", none="max(2048, max_model_len)"
    )
    enable_chunked_prefill: bool = option(
        True,
        "compute prompts longer than max_num_batched_tokens over several steps (decodes first, then prompt "
        "chunks), so max_num_batched_tokens may be far below max_model_len",
        group="scheduling",
    )
    scheduler: str = option(
        "vtc", "vtc: fair across tenants (Virtual Token Counter); fcfs: first come first served",
        group="scheduling", choices=SCHEDULERS,
    )  # fmt: skip
    max_queue_len: int = option(4096, "waiting requests beyond this are refused (overloaded)", group="scheduling")
    num_scheduler_steps: int = option(
        1, "decode steps run back to back per plan while nothing waits (vLLM's multi-step scheduling)",
        group="scheduling", at_least=1,
    )  # fmt: skip
    reserved_tail_lanes: int | None = option(
        None,
        "of the max_loras lanes (distinct adapters) of a batch, this many are kept for adapters with a single "
        "queued request, so the long tail is not starved by hot adapters; lent to anyone while no such request "
        "waits (vtc only; docs/scheduling.md)",
        group="scheduling",
        none="max_loras // 8",
    )
    lane_age_deadline_s: float = option(
        1.0,
        "a request queued this long may open any lane, tail lanes included, or claim the next general lane that "
        "frees (the adapter holding one longest then takes no new requests until it frees it) (vtc only)",
        group="scheduling",
        at_least=0,
    )
    lane_lend_max_tokens: int = option(
        16,
        "decode steps a tail lane lent to general traffic is kept once a single-request adapter wants it: then "
        "the recalled holder's rows are preempted (recomputed later), so a tail adapter waits at most this many "
        "steps for its lane; 16 at 50 ms a step is 0.8 s, inside a 1 s p95 TTFT; nothing is lost while nobody "
        "waits (vtc only; 0: unbounded, it waits for the holder's whole generation)",
        group="scheduling",
        at_least=0,
    )
    # -- prefix cache ---------------------------------------------------------------------------
    enable_prefix_caching: bool = option(
        True,
        "keep full KV blocks by content (per base and adapter registration) and reuse them for later prompts "
        "that start the same way; idle cached blocks are the first pages given back",
        group="memory",
    )
    # -- adapters -------------------------------------------------------------------------------
    max_loras: int = option(
        32,
        "distinct adapters one step's batch may hold (vLLM's max_loras): a decode step reads each distinct "
        "adapter once, so this bounds what adapters add to a step",
        group="adapters",
        at_least=1,
    )
    max_resident_loras: int | None = option(
        None,
        "lora slots: adapters resident in the pool at once (>= max_loras); the pool's pages bound them too, and "
        "idle ones give way to KV blocks by value per page. An auto-sized pool makes room for this many adapters "
        "of max_lora_rank",
        group="adapters",
        none=f"as many adapters of max_lora_rank as the whole pool holds, at least max_loras and at most "
        f"{MAX_DERIVED_LORA_SLOTS} (the lookup tables grow with the slots)",
        at_least=1,
    )
    max_lora_rank: int = option(64, "the highest adapter rank accepted", group="adapters", at_least=1)
    max_cpu_loras: int = option(
        128,
        "adapters kept in host RAM (their packed copies, least recently used go first)",
        group="adapters",
        at_least=1,
    )
    max_cpu_lora_bytes: int | None = option(
        None,
        "bytes the adapters' copies in host RAM may take together; past it, as past max_cpu_loras, the least "
        "recently used copies are dropped",
        group="adapters",
        none="no byte bound (max_cpu_loras only)",
        at_least=1,
    )
    adapter_wait_s: float = option(
        1.0,
        "a load that has waited this long for a lora slot (every resident adapter busy) makes the least "
        "valuable busy adapter yield: it takes no new requests, and its slot goes to the load once its running "
        "requests finish (without it a cold adapter could wait forever behind hot ones)",
        group="adapters",
        at_least=0,
    )
    max_pinned_fraction: float = option(
        0.5,
        "admins may pin adapters resident (never evicted); together pins hold at most this fraction of the "
        "pool's pages (and always leave room for one full-length sequence and one adapter)",
        group="adapters",
        at_least=0,
        at_most=1,
    )
    cost_reference_batch: int = option(
        64,
        "rows of a decode step, each on its own adapter, that an adapter's projected cost assumes (the design's "
        "64): projected cost = batch x adapter bytes / base bytes, since the base is read once per step and each "
        "distinct adapter once for its rows (docs/capacity.md)",
        group="adapters",
        at_least=1,
    )
    shared_envelope: str | None = option(
        None,
        "adapter shapes the shared pool serves: comma-separated MODULES:RANK rules, MODULES one of attention "
        "(q/k/v/o_proj only), mlp (gate/up/down_proj only) or all; an adapter within a rule (and within "
        "shared_max_cost_pct) is tier shared, any other is tier dedicated, served by a dedicated merged deployment "
        "of its own, and refused with its projected cost while none is configured. The design's envelope for its "
        "70B is attention:16,all:8; '' sets no shape rule",
        group="adapters",
        none="all:MAX_LORA_RANK, every rank max_lora_rank accepts: a rank the engine accepts is served unless an "
        f"envelope says otherwise ({FLEET_ENVELOPE} in lorapage fleet and capacity: a dedicated tier takes the rest)",
    )
    shared_max_cost_pct: float | None = option(
        None,
        "an adapter whose projected decode cost at cost_reference_batch is above this percent of the base's is tier "
        "dedicated (the design's bound is 10)",
        group="adapters",
        none="no bound on the cost",
        at_least=0,
    )
    max_adapter_tokens: int | None = option(
        None,
        "on the shared pool, a request on an adapter may ask for at most this many tokens (max_tokens); more is "
        "refused 400 adapter_tokens_over_shared_limit, naming the dedicated tier (lorapage serve --merge "
        "ADAPTER), where long generations of one adapter run merged into the base. Requests on the base are not "
        "bounded by it; a chat request that sets no max_tokens gets this many at most",
        group="adapters",
        none="no bound",
        at_least=1,
    )
    tier_hot_requests_per_hour: float = option(
        120.0,
        "an adapter version with at least this many requests in the last hour is tier hot (kept resident, "
        "within max_pinned_fraction beside the admin pins); tiers come from the hourly traffic table, never "
        "from the customer (docs/scheduling.md)",
        group="adapters",
        above=0,
    )
    tier_hot_share: float = option(
        0.1,
        "a version with at least this share of every adapter's requests in the last hour is hot too, once that "
        "total reaches tier_hot_requests_per_hour",
        group="adapters",
        above=0,
        at_most=1,
    )
    tier_hot_exit_ratio: float = option(
        0.5,
        "a hot version stays hot until its requests and its share both fall below this fraction of the hot "
        "thresholds (hysteresis: no flapping around a threshold)",
        group="adapters",
        above=0,
        at_most=1,
    )
    tier_min_hold_s: float = option(
        600.0,
        "no version leaves a traffic tier for a lower one before holding it this long (warm: some traffic in "
        "the last 24 hours, read into host RAM; cold: none, loaded on demand)",
        group="adapters",
        at_least=0,
    )
    tier_interval_s: float = option(
        300.0,
        "every this many seconds the engine writes its batched traffic counts to the registry and re-evaluates "
        "every version's traffic tier (off the event loop)",
        group="adapters",
        above=0,
    )
    traffic_retention_hours: int = option(
        14 * 24,
        "hours of the registry's hourly traffic table (requests and tokens per adapter version) kept; older "
        "hours are deleted as new counts are written",
        group="adapters",
        shown="336 (14 days)",
        at_least=25,
    )
    audit_retention_days: float = option(
        90.0,
        "days the registry's audit trail keeps a row; older rows are deleted with the traffic table's writes "
        "(off the event loop; 0: kept forever)",
        group="adapters",
        at_least=0,
    )
    base_names: str | None = option(
        None,
        'a TOML file naming the bases adapters were trained on, one per line: "NAME" = "sha256:<64 hex>", NAME as '
        "a PEFT adapter's base_model_name_or_path says it, the digest that base's weights have (lorapage base "
        "digest DIR). Registration binds each adapter to the base its expected_base_digest, else its name, says; "
        "an adapter trained on another base than the running one is refused (409)",
        group="adapters",
        none="the running base's own names only: its directory's path (or any trailing part of it) and its "
        "config's _name_or_path",
    )
    allow_unbound: bool = option(
        False,
        "register an adapter whose trained-on base cannot be told (no expected_base_digest, and a "
        "base_model_name_or_path neither in --base-names nor naming the running base) as trained on the running "
        "base, as before registration required it; without it such an adapter is refused (400 adapter_base_unknown)",
        group="adapters",
    )
    metrics_top_adapters: int = option(
        20, "per-adapter metrics name the top this many adapters by recent traffic; the rest are 'other'",
        group="adapters", at_least=1,
    )  # fmt: skip
    # -- kernels and threads --------------------------------------------------------------------
    kernel_backend: str = option(
        "auto",
        "the LoRA and attention ops; auto: triton on CUDA, the C kernels on a CPU (torch where they cannot build)",
        group="kernels",
        choices=KERNEL_BACKENDS,
    )
    enforce_eager: bool = option(False, "no CUDA-graph capture of decode steps (CUDA + Triton only)", group="kernels")
    num_threads: int | None = option(
        None,
        "intra-op threads of the forward pass (torch's threads in the forward thread)",
        group="kernels",
        none="on a CPU, torch's setting (OMP_NUM_THREADS, torch.set_num_threads, else its core count), at most "
        "the cores this process may run on; on CUDA, torch's setting",
        at_least=1,
    )
    io_threads: int | None = option(
        None,
        "threads for adapter file reads, digests and (on a CPU) copies into the pool, never the event loop",
        group="kernels",
        none="4 on CUDA; on a CPU, the cores the forward's threads leave free (2-4)",
        at_least=1,
    )
    gil_switch_interval_s: float | None = option(
        0.0005,
        "the engine makes Python's thread switch interval at most this (process-wide): the forward thread re-takes "
        "the GIL after every op, and at CPython's default 5 ms another thread running Python can make it wait so long",
        group="kernels",
        none="leave it",
        above=0,
    )
    lora_side_thread: bool | None = option(
        None,
        "on a CPU, each projection's LoRA update runs on a thread of its own beside the base's projection",
        group="kernels",
        none="where the forward's intra-op threads leave a core free (one device)",
    )
    # -- state ----------------------------------------------------------------------------------
    state_dir: str | None = option(
        None,
        "the adapter registry (ids, versions, aliases, owners) lives in STATE_DIR/registry.sqlite3 across restarts",
        group="state",
        none="in memory for this engine's life",
    )
    adapter_cache_dir: str | None = option(
        None,
        "remote adapter sources (https, s3, hf) download into this content-addressed cache",
        group="state",
        none="STATE_DIR/adapter-cache, or no remote sources without a state dir",
    )
    adapter_cache_bytes: int = option(
        20 << 30, "cap of that cache (least recently used entries go first)", group="state", shown="20 GiB", at_least=1
    )
    max_adapter_download_bytes: int = option(
        4 << 30, "cap of one adapter download (its two files together)", group="state", shown="4 GiB", at_least=1
    )
    adapter_download_timeout_s: float = option(
        600.0,
        "a download of one adapter (both files) still running after this long is cut: the registration, or the "
        "requests waiting for the load, fail (502) rather than wait on a source that never finishes",
        group="state",
        above=0,
    )
    min_adapter_download_bytes_per_s: int = option(
        64 << 10,
        "a download averaging fewer bytes per second than this, once its first 10 s have passed, is cut "
        "(0: no floor): a source that trickles a byte now and then cannot hold a registration or a load",
        group="state",
        at_least=0,
    )
    allow_private_adapter_sources: bool = option(
        False,
        "https adapter sources, and every redirect they follow, may reach loopback and private addresses (a "
        "local mirror, tests); without it only public ones. Link-local addresses (cloud metadata) never",
        group="state",
    )
    s3_endpoint_url: str | None = option(
        None, "an S3-compatible store for s3:// sources", group="state", none="AWS's, from boto3's config"
    )
    hf_endpoint: str | None = option(
        None, "a Hugging Face Hub mirror for hf:// sources", group="state", none="huggingface_hub's default"
    )

    @property
    def resolved_lora_dtype(self) -> str:
        """The adapters' dtype by name: ``lora_dtype``, with auto meaning the model's."""
        return self.dtype if self.lora_dtype == "auto" else self.lora_dtype

    @property
    def kv_dtype_name(self) -> str:
        """The KV pages' dtype by name: ``kv_cache_dtype``'s, with auto meaning the model's."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype) or self.dtype

    @property
    def envelope_rules(self) -> str:
        """``shared_envelope`` as set, else ``all:{max_lora_rank}``: a user who raises
        max_lora_rank means those ranks to be served, and one machine has no dedicated tier to
        send the others to."""
        return f"all:{self.max_lora_rank}" if self.shared_envelope is None else self.shared_envelope

    def __post_init__(self) -> None:
        for f in fields(self):
            value, values = getattr(self, f.name), f.metadata["choices"]
            if values is not None and value not in (*values, *((None,) if f.default is None else ())):
                raise ValueError(f"EngineConfig.{f.name} must be one of {values}; got {value!r}")
            # None: counted from the device and its cores, or off
            if value is not None and (rule := bounds_error(value, f.metadata["bounds"])) is not None:
                raise ValueError(f"EngineConfig.{f.name} must be {rule}; got {value}")
        if self.resolved_lora_dtype not in (self.dtype, *NARROW_LORA_DTYPES.get(self.dtype, ())):
            raise ValueError(
                f"EngineConfig.lora_dtype {self.lora_dtype!r} cannot serve a {self.dtype} model: adapters are kept "
                "in the model's dtype, or in bfloat16 / float16 under a float32 one (pages share the pool's "
                "memory, and the ops widen weights to the model's dtype, which another 16-bit type is not)"
            )
        if self.resolved_lora_dtype == "int8" and (self.kernel_backend == "triton" or self.tensor_parallel_size > 1):
            what = "kernel_backend 'triton'" if self.kernel_backend == "triton" else "tensor_parallel_size > 1"
            raise ValueError(
                f"EngineConfig.lora_dtype 'int8' cannot run with {what}: int8 adapter pages are read by the C kernels "
                "and the torch backend on one device; use kernel_backend cpu / torch / auto on a CPU, or lora_dtype "
                "bfloat16"
            )
        if self.quantization not in (None, "fp8") and self.dtype != "float32":
            raise ValueError(
                f"EngineConfig.quantization {self.quantization!r} needs dtype float32 (its kernels take float32 "
                f"activations into an int8 GEMM and give float32 back); got {self.dtype}"
            )
        if self.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype {self.kv_cache_dtype!r}: an fp8 KV cache is not supported (a CPU has no "
                "fp8 arithmetic, and lorapage's CUDA kernels read 16- and 32-bit pages only); use fp16 or bf16"
            )
        if self.dtype != "float32" and self.kv_dtype_name != self.dtype:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype {self.kv_cache_dtype!r} cannot serve a {self.dtype} model: a 16-bit "
                "model keeps K and V in its own dtype (auto); fp16 / bf16 pages are for a float32 model"
            )
        parse_envelope_rules(self.envelope_rules)
        if self.max_resident_loras is not None and self.max_resident_loras < self.max_loras:
            raise ValueError(
                f"EngineConfig.max_resident_loras ({self.max_resident_loras}) must be >= max_loras "
                f"({self.max_loras}): every adapter of a batch is resident; lower --max-loras or raise "
                "--max-resident-loras"
            )
        if self.reserved_tail_lanes is not None and not 0 <= self.reserved_tail_lanes < self.max_loras:
            raise ValueError(
                f"EngineConfig.reserved_tail_lanes must be in [0, max_loras={self.max_loras}); "
                f"got {self.reserved_tail_lanes}"
            )


def parse_envelope_rules(text: str) -> tuple[tuple[str, int], ...]:
    """``shared_envelope`` as (module class, highest rank) rules: ``"attention:16,all:8"`` ->
    ``(("attention", 16), ("all", 8))``; ``""`` -> no rule. Raises ValueError naming the bad rule."""
    rules = []
    for raw in filter(None, (part.strip() for part in text.split(","))):
        kind, _, rank = raw.partition(":")
        if kind.strip() not in ENVELOPE_MODULE_CLASSES or not rank.strip().isdigit() or int(rank) < 1:
            raise ValueError(
                f"EngineConfig.shared_envelope rule {raw!r} is not MODULES:RANK with MODULES one of "
                f"{', '.join(ENVELOPE_MODULE_CLASSES)} and RANK >= 1 (e.g. attention:16,all:8)"
            )
        rules.append((kind.strip(), int(rank)))
    return tuple(rules)

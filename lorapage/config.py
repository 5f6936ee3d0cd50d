"""Frozen engine configuration, with vLLM-familiar names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorapage.kernels.backend import BACKENDS

TINY_MODEL_DIR = Path(__file__).parent / "assets" / "tiny"
DEFAULT_TENANT = "default"  # the embedded engine's tenant when a request names none

# The values EngineConfig accepts for its option fields (the CLI offers the same).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
LORA_DTYPE_NAMES = ("auto", *DTYPE_NAMES)  # auto: the model's dtype
NARROW_LORA_DTYPES = {"float32": ("bfloat16", "float16")}  # per model dtype, the narrower ones adapters may take
KERNEL_BACKENDS = BACKENDS  # defined beside the kernels, which know nothing of this config
SCHEDULERS = ("fcfs", "vtc")


@dataclass(frozen=True)
class EngineConfig:
    """Everything fixed when an :class:`~lorapage.Engine` starts.

    Memory: one pool of ``num_pages`` pages (``None``: sized from ``max_num_seqs``,
    ``max_model_len`` and ``max_loras`` adapters of ``max_lora_rank`` on every module) holds KV
    blocks of ``block_size`` tokens and resident adapters alike.
    """

    model: str = str(TINY_MODEL_DIR / "base")
    dtype: str = "float32"  # float32 | bfloat16 | float16
    # The dtype adapter weights are kept in, in the pool and in host RAM (vLLM's lora_dtype).
    # auto: the model's. bfloat16 under a float32 model halves every adapter's bytes (twice the
    # adapters per page budget, half the bytes a step reads per adapter) at bfloat16's rounding
    # of each weight; the LoRA ops still compute in the model's dtype. Under a 16-bit model:
    # that model's dtype only.
    lora_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped at 8192)
    block_size: int = 16
    num_pages: int | None = None
    max_num_seqs: int = 64
    # On CUDA an auto-sized pool (num_pages=None) stops where the device would pass this fraction
    # of its memory, counting the weights already loaded and one step's activations (as vLLM's
    # gpu_memory_utilization); an explicit num_pages is taken as given.
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len)
    # Prompts longer than a step's token budget are computed over several steps (decodes first,
    # then prompt chunks), so max_num_batched_tokens may be far below max_model_len.
    enable_chunked_prefill: bool = True
    # Full KV blocks are kept by content (per base and adapter registration) and reused by later
    # prompts that start the same way; idle cached blocks are the first pages given back.
    enable_prefix_caching: bool = True
    max_loras: int = 32  # lora slots: adapters resident in the pool at once
    max_lora_rank: int = 64
    max_cpu_loras: int = 128  # adapters kept in host RAM
    # A load that has waited this long for a lora slot (every resident adapter busy) makes the
    # least valuable busy adapter yield: it takes no new requests, and its slot goes to the load
    # once its running requests finish. Without it a cold adapter could wait forever behind hot ones.
    adapter_wait_s: float = 1.0
    # Admins may pin adapters resident (never evicted); together pins hold at most this fraction
    # of the pool's pages (and always leave room for one full-length sequence and one adapter).
    max_pinned_fraction: float = 0.5
    # Per-adapter metrics name the top this many adapters by recent traffic; the rest are "other".
    metrics_top_adapters: int = 20
    max_queue_len: int = 4096  # waiting requests beyond this are refused (overloaded)
    kernel_backend: str = "auto"  # auto | torch | cpu | triton
    enforce_eager: bool = False  # True: no CUDA-graph capture of decode steps (CUDA + Triton only)
    scheduler: str = "vtc"  # vtc (fair across tenants) | fcfs
    seed: int = 0
    # Adapter file reads, digests and (on a CPU) copies into the pool run on these threads, never
    # on the event loop. None: 4 on CUDA; on a CPU, the cores the forward's threads leave free (2-4).
    io_threads: int | None = None
    # The engine makes Python's thread switch interval at most this (process-wide; None: leaves
    # it): the forward thread re-takes the GIL after every op, and at CPython's default 5 ms any
    # other thread running Python can make it wait that long each time (engine/devices.py).
    gil_switch_interval_s: float | None = 0.0005
    # The adapter registry (ids, versions, aliases, owners) lives in STATE_DIR/registry.sqlite3
    # and survives restarts; None keeps it in memory for this engine's life.
    state_dir: str | None = None
    # Remote adapter sources (https, s3, hf) download into this content-addressed cache, at most
    # adapter_cache_bytes (least recently used entries go first); None: STATE_DIR/adapter-cache,
    # or no remote sources when there is no state_dir either.
    adapter_cache_dir: str | None = None
    adapter_cache_bytes: int = 20 << 30
    max_adapter_download_bytes: int = 4 << 30  # one version's two files together
    s3_endpoint_url: str | None = None  # an S3-compatible store (None: AWS's, from boto3's config)
    hf_endpoint: str | None = None  # a Hugging Face Hub mirror (None: huggingface_hub's default)

    @property
    def resolved_lora_dtype(self) -> str:
        """The adapters' dtype by name: ``lora_dtype``, with auto meaning the model's."""
        return self.dtype if self.lora_dtype == "auto" else self.lora_dtype

    def __post_init__(self) -> None:
        allowed = {
            "dtype": DTYPE_NAMES,
            "lora_dtype": LORA_DTYPE_NAMES,
            "kernel_backend": KERNEL_BACKENDS,
            "scheduler": SCHEDULERS,
        }
        for name, values in allowed.items():
            if getattr(self, name) not in values:
                raise ValueError(f"EngineConfig.{name} must be one of {values}; got {getattr(self, name)!r}")
        if self.resolved_lora_dtype not in (self.dtype, *NARROW_LORA_DTYPES.get(self.dtype, ())):
            raise ValueError(
                f"EngineConfig.lora_dtype {self.lora_dtype!r} cannot serve a {self.dtype} model: adapters are kept "
                "in the model's dtype, or in bfloat16 / float16 under a float32 one (pages share the pool's "
                "memory, and the ops widen weights to the model's dtype, which another 16-bit type is not)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            raise ValueError(f"EngineConfig.gil_switch_interval_s must be > 0; got {self.gil_switch_interval_s}")
        if not self.adapter_wait_s >= 0:
            raise ValueError(f"EngineConfig.adapter_wait_s must be >= 0; got {self.adapter_wait_s}")
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError(f"EngineConfig.max_pinned_fraction must be in [0, 1]; got {self.max_pinned_fraction}")
        positive = (
            "block_size",
            "max_num_seqs",
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
            "io_threads",
            "adapter_cache_bytes",
            "max_adapter_download_bytes",
            "metrics_top_adapters",
        )
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:  # None: io_threads counted from the device
                raise ValueError(f"EngineConfig.{name} must be >= 1; got {value}")

"""Gather kernels over lorapage's unified page pool, each beside a PyTorch reference.

Imported as ``lorapage.kernels``. Nothing here imports the engine: every op takes plain tensors
(the pool slab of one layer, the lookup tables, the per-token indices) and writes into an output
it is given. ``docs/kernels.md`` describes the index layout. The Triton kernels
(``lora_triton``, ``attention_triton``) are imported only by ``select_backend("triton", ...)``.
"""

from lorapage.kernels.attention_ref import (
    paged_decode_attention_ref,
    prefill_attention_ref,
    write_kv_ref,
)
from lorapage.kernels.backend import KernelOps, select_backend
from lorapage.kernels.lora_ref import LoraIndices, lora_expand_ref, lora_shrink_ref

__all__ = [
    "LoraIndices",
    "lora_shrink_ref",
    "lora_expand_ref",
    "write_kv_ref",
    "paged_decode_attention_ref",
    "prefill_attention_ref",
    "KernelOps",
    "select_backend",
]

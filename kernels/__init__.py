"""Gather kernels over lorapage's unified page pool, each beside a PyTorch reference.

Imported as ``lorapage.kernels``. Nothing here imports the engine: every op takes plain tensors
(the pool slab of one layer, the lookup tables, the per-token indices) and writes into an output
it is given. ``docs/kernels.md`` describes the index layout.
"""

from lorapage.kernels.lora_ref import LoraIndices, lora_expand_ref, lora_shrink_ref
from lorapage.kernels.attention_ref import (
    paged_decode_attention_ref,
    prefill_attention_ref,
    write_kv_ref,
)

__all__ = [
    "LoraIndices",
    "lora_shrink_ref",
    "lora_expand_ref",
    "write_kv_ref",
    "paged_decode_attention_ref",
    "prefill_attention_ref",
]

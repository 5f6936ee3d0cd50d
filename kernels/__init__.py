"""Gather kernels over lorapage's unified page pool, each beside a PyTorch reference.

Imported as ``lorapage.kernels``. Nothing here imports the engine: every op takes plain tensors
(the pool slab of one layer, the lookup tables, the per-token indices) and writes into an output
it is given. ``docs/kernels.md`` describes the index layout. The Triton kernels
(``lora_triton``, ``attention_triton``) are imported only by ``select_backend("triton", ...)``.
"""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.kernels.attention_ref import (
        paged_decode_attention_ref as paged_decode_attention_ref,
        prefill_attention_ref as prefill_attention_ref,
        write_kv_ref as write_kv_ref,
    )
    from lorapage.kernels.backend import KernelOps as KernelOps, select_backend as select_backend
    from lorapage.kernels.lora_ref import (
        LoraIndices as LoraIndices,
        lora_expand_ref as lora_expand_ref,
        lora_shrink_ref as lora_shrink_ref,
    )

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "LoraIndices": "lorapage.kernels.lora_ref",
        "lora_shrink_ref": "lorapage.kernels.lora_ref",
        "lora_expand_ref": "lorapage.kernels.lora_ref",
        "write_kv_ref": "lorapage.kernels.attention_ref",
        "paged_decode_attention_ref": "lorapage.kernels.attention_ref",
        "prefill_attention_ref": "lorapage.kernels.attention_ref",
        "KernelOps": "lorapage.kernels.backend",
        "select_backend": "lorapage.kernels.backend",
    },
)

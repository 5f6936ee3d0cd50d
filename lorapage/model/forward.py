"""What one forward pass reads, and the decode step that CUDA graphs capture.

Both the eager runner and :class:`~lorapage.model.cuda_graphs.DecodeGraphs` run the model through
one :class:`ForwardContext`, so a captured graph and an eager step read the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lorapage.kernels import LoraIndices
from lorapage.kernels.backend import KernelOps
from lorapage.memory.pool import PagePool
from lorapage.model.llama import AttentionMetadata, LlamaModel
from lorapage.model.lora_tables import LoraTables
from lorapage.model.step_buffers import StepBuffers


@dataclass(frozen=True)
class ForwardContext:
    """The model, its kernels, the pool, the adapters' lookup tables and the step buffers."""

    model: LlamaModel
    ops: KernelOps
    pool: PagePool
    tables: LoraTables
    buffers: StepBuffers
    block_size: int

    def forward(self, num_tokens: int, attn: AttentionMetadata, lora: LoraIndices | None) -> Tensor:
        """Hidden states of the first ``num_tokens`` tokens written into the buffers."""
        b = self.buffers
        return self.model.forward(
            b.input_ids[:num_tokens],
            b.positions[:num_tokens],
            attn,
            self.pool.kv_storage,
            self.pool.adapter_storage,
            self.block_size,
            self.ops,
            self.tables,
            lora,
            b.lora_h,
        )


def decode_forward(ctx: ForwardContext, size: int) -> Tensor:
    """The decode step a graph captures: the first ``size`` rows of the static buffers through the
    model. Everything it reads is a view of a buffer allocated once or a constant of ``size``;
    ``tests/kernels/test_kernels_graph_safety.py`` checks that its kernel launches do not change with the
    adapters, slots, pages or positions written into those buffers."""
    b = ctx.buffers
    attn = AttentionMetadata(
        slot_mapping=b.slot_mapping[:size],
        num_decode=size,
        decode_block_table=b.block_tables[:size],
        decode_context_lens=b.context_lens[:size],
        prefill_block_table=b.block_tables[:0],
        prefill_query_starts=[0],
        prefill_context_lens=[],
    )
    # The segments are a placeholder: BGMV reads token_slot on the device, so the LoRA kernels
    # are always in the graph and rows with slot 0 skip them.
    lora = LoraIndices(b.token_slot[:size], ((0, size, 0),))
    with torch.inference_mode():
        return ctx.forward(size, attn, lora)

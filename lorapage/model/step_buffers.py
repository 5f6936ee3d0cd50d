"""The step's device buffers: allocated once at their maximum size, then only written into.

The eager runner and the captured decode graphs share one :class:`StepBuffers`; a graph replays
over exactly these tensors, which is why nothing here is ever reallocated or resized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class StepBuffers:
    """Per-token and per-row inputs of one step. Index ``t`` is a token of the step, ``row`` a
    sequence of the step (decode rows first)."""

    input_ids: Tensor  # [t]: token id
    positions: Tensor  # [t]: position in its sequence
    slot_mapping: Tensor  # [t]: KV position written, page * block_size + offset (vLLM's name)
    token_slot: Tensor  # [t]: lora slot of the token's adapter (0 = none)
    block_tables: Tensor  # [row, i]: page id of the row's i-th KV block
    context_lens: Tensor  # [row]: tokens of context including this step's
    lora_h: Tensor  # [t, width]: the LoRA shrink output, the expand's input

    @classmethod
    def allocate(
        cls,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        lora_h_width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> StepBuffers:
        def ints(*shape: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        t = max_num_batched_tokens
        return cls(
            input_ids=ints(t),
            positions=ints(t),
            slot_mapping=ints(t),
            token_slot=ints(t, dtype=torch.int32),
            block_tables=ints(max_num_seqs, max_blocks_per_seq, dtype=torch.int32),
            context_lens=ints(max_num_seqs, dtype=torch.int32),
            lora_h=torch.zeros(t, lora_h_width, dtype=dtype, device=device),
        )

    def pad_rows(self, start: int, end: int) -> None:
        """Rows [start, end) of a decode step become harmless: token 0 at position 0, no adapter,
        writing their K/V into the dummy page 0 and attending over it alone."""
        for buf in (self.input_ids, self.positions, self.slot_mapping, self.token_slot, self.block_tables):
            buf[start:end].zero_()
        self.context_lens[start:end].fill_(1)

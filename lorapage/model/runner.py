"""Turns a step's scheduled sequences into tensors and runs the forward pass and sampling.

The engine builds a :class:`StepPlan` (plain Python data) on its event loop; :meth:`ModelRunner.execute`
runs in the single forward thread, writes the plan into buffers allocated once, and returns the
sampled tokens. Token order: decode tokens first (one per sequence), then each prefill sequence's
tokens; within each part sequences are sorted by adapter slot so a slot's tokens are one segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorapage.adapters.layout import LoraTables
from lorapage.kernels import LoraIndices
from lorapage.kernels.backend import KernelOps
from lorapage.memory.pool import PagePool
from lorapage.model.cuda_graphs import Capture, DecodeGraphs
from lorapage.model.llama import AttentionMetadata, LlamaModel
from lorapage.model.sampler import SampleRow, TokenLogprob, sample
from lorapage.request import Request


@dataclass
class StepPlan:
    """One step's inputs as host data, built on the event loop."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    token_slot: list[int]
    segments: tuple[tuple[int, int, int], ...]
    num_decode: int
    block_tables: list[list[int]]  # per sequence, decode sequences first
    context_lens: list[int]
    prefill_query_starts: list[int]  # relative to num_decode, with the end appended
    sample_index: list[int]  # token index of each sequence's last token
    sample_rows: list[SampleRow]
    sequences: list[Request]  # in row order: sample_index[i] belongs to sequences[i]

    @classmethod
    def build(cls, decode: list[Request], prefill: list[Request], block_size: int) -> StepPlan:
        decode = sorted(decode, key=lambda r: r.lora_slot)
        prefill = sorted(prefill, key=lambda r: r.lora_slot)
        ids, pos, slots, token_slot, sample_index = [], [], [], [], []
        starts = [0]
        for r in decode + prefill:
            seq = r.all_ids()
            new = range(r.num_computed, len(seq))
            ids.extend(seq[r.num_computed :])
            pos.extend(new)
            slots.extend(r.block_table[p // block_size] * block_size + p % block_size for p in new)
            token_slot.extend([r.lora_slot] * len(new))
            sample_index.append(len(ids) - 1)
        for r in prefill:
            starts.append(starts[-1] + r.num_tokens - r.num_computed)
        return cls(
            input_ids=ids,
            positions=pos,
            slot_mapping=slots,
            token_slot=token_slot,
            segments=_segments(token_slot),
            num_decode=len(decode),
            block_tables=[r.block_table for r in decode + prefill],
            context_lens=[r.num_tokens for r in decode + prefill],
            prefill_query_starts=starts,
            sample_index=sample_index,
            sample_rows=[SampleRow(r.sampling, r.generator, r.output_ids) for r in decode + prefill],
            sequences=decode + prefill,
        )


def _segments(token_slot: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Runs of equal non-zero slot: (start, end, slot)."""
    out, start = [], 0
    for i in range(1, len(token_slot) + 1):
        if i == len(token_slot) or token_slot[i] != token_slot[start]:
            if token_slot[start]:
                out.append((start, i, token_slot[start]))
            start = i
    return tuple(out)


class ModelRunner:
    """Owns the model, the ops and the step buffers; runs one step at a time (one thread)."""

    def __init__(
        self,
        model: LlamaModel,
        pool: PagePool,
        tables: LoraTables,
        ops: KernelOps,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int,
        lora_h_width: int,
    ) -> None:
        self.model, self.pool, self.tables, self.ops = model, pool, tables, ops
        self.block_size = block_size
        dev = model.device
        i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
        # Step buffers, allocated once at their maximum size and only written into.
        self.input_ids = torch.zeros(max_num_batched_tokens, **i64)  # [t]: token id
        self.positions = torch.zeros(max_num_batched_tokens, **i64)  # [t]: position in its sequence
        self.slot_mapping = torch.zeros(max_num_batched_tokens, **i64)  # [t]: page * block_size + offset
        self.token_slot = torch.zeros(max_num_batched_tokens, **i32)  # [t]: adapter slot (0 = none)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, **i32)  # [row, i]: i-th KV page
        self.context_lens = torch.zeros(max_num_seqs, **i32)  # [row]: tokens of context incl. this step
        self.lora_h = torch.zeros(max_num_batched_tokens, lora_h_width, dtype=model.dtype, device=dev)
        self.graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_num_seqs: int, capture: Capture | None = None) -> None:
        """Capture decode steps as CUDA graphs (CUDA with the Triton kernels only; ``capture``:
        see :class:`DecodeGraphs`)."""
        self.graphs = DecodeGraphs(self, max_num_seqs, capture)

    def execute(self, plan: StepPlan) -> tuple[list[int], list[TokenLogprob | None]]:
        """Forward the plan's tokens and sample one token per sequence."""
        T, B = len(plan.input_ids), len(plan.block_tables)
        for buf, values in (
            (self.input_ids, plan.input_ids),
            (self.positions, plan.positions),
            (self.slot_mapping, plan.slot_mapping),
            (self.token_slot, plan.token_slot),
        ):
            buf[:T].copy_(torch.tensor(values, dtype=buf.dtype))
        nd = plan.num_decode
        if self.graphs is not None and nd == B and self.graphs.bucket(B) is not None:
            return self._replay(plan)
        width = max(len(b) for b in plan.block_tables)
        padded = [b + [0] * (width - len(b)) for b in plan.block_tables]
        self.block_tables[:B, :width].copy_(torch.tensor(padded, dtype=torch.int32))
        self.context_lens[:B].copy_(torch.tensor(plan.context_lens, dtype=torch.int32))
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:T],
            num_decode=nd,
            decode_block_table=self.block_tables[:nd, :width],
            decode_context_lens=self.context_lens[:nd],
            prefill_block_table=self.block_tables[nd:B, :width],
            prefill_query_starts=plan.prefill_query_starts,
            prefill_context_lens=plan.context_lens[nd:],
        )
        lora = LoraIndices(self.token_slot[:T], plan.segments) if plan.segments else None
        if lora is not None and self.ops.name == "triton" and T > nd:
            lora = lora.with_segment_table()  # prefill tokens: segment-wise SGMV beats per-token BGMV
        with torch.inference_mode():
            hidden = self.model.forward(
                self.input_ids[:T],
                self.positions[:T],
                attn,
                self.pool.storage,
                self.block_size,
                self.ops,
                self.tables,
                lora,
                self.lora_h,
            )
            logits = self.model.logits(hidden[plan.sample_index])
            return sample(logits, plan.sample_rows)

    def _replay(self, plan: StepPlan) -> tuple[list[int], list[TokenLogprob | None]]:
        """A decode-only step through its captured graph: write the rows, pad, replay."""
        B = len(plan.block_tables)
        full = self.block_tables.shape[1]  # graphs read the block table at its full width
        padded = [b + [0] * (full - len(b)) for b in plan.block_tables]
        self.block_tables[:B].copy_(torch.tensor(padded, dtype=torch.int32))
        self.context_lens[:B].copy_(torch.tensor(plan.context_lens, dtype=torch.int32))
        hidden = self.graphs.run(B)
        with torch.inference_mode():
            return sample(self.model.logits(hidden), plan.sample_rows)

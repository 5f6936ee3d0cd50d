"""Turns a step's scheduled sequences into tensors and runs the forward pass and sampling.

The engine builds a :class:`StepPlan` (plain Python data) on its event loop; :meth:`ModelRunner.execute`
runs in the single forward thread, writes the plan into buffers allocated once, and returns the
sampled tokens. Token order: decode tokens first (one per sequence), then each prefill sequence's
tokens; within each part sequences are sorted by adapter slot so a slot's tokens are one segment.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lorapage.kernels import LoraIndices
from lorapage.kernels.backend import KernelOps
from lorapage.memory.pool import PagePool
from lorapage.model.cuda_graphs import Capture, DecodeGraphs, batch_buckets
from lorapage.model.forward import ForwardContext
from lorapage.model.llama import AttentionMetadata, LlamaModel
from lorapage.model.lora_tables import LoraTables
from lorapage.model.sampler import SampleOutput, SampleRow, sample, token_logprobs
from lorapage.model.step_buffers import StepBuffers
from lorapage.request import Request, TokenLogprob
from lorapage.structured.masks import bitmask_words, fill_bitmask


@dataclass(frozen=True)
class StepInputs:
    """What a step's forward reads: the plan less its requests and sampling (all that crosses to
    the other tensor-parallel ranks each step, :mod:`lorapage.parallel`)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    token_slot: list[int]
    segments: tuple[tuple[int, int, int], ...]
    num_decode: int
    block_tables: list[list[int]]
    context_lens: list[int]
    prefill_query_starts: list[int]
    # Under tensor parallelism: the hidden rows whose logits rank 0 computes this step, in order
    # (the vocabulary-parallel lm_head gathers every rank's share of them); empty on one device.
    logits_rows: tuple[int, ...] = ()
    # A decode-only step that fits a captured graph: the graph's size (its rows padded to it),
    # chosen once by rank 0 so every rank replays the same graph; 0: the step runs eagerly.
    graph_size: int = 0


@dataclass
class StepPlan:
    """One step's inputs as host data, built on the event loop.

    Each sequence feeds ``fed[i]`` tokens from its first uncomputed one: 1 for a decode, a whole
    prompt or one chunk of it for a prefill. Only a sequence whose tokens are all computed after
    this step samples its next token (``completes[i]``); a chunk of a longer prompt samples
    nothing, so a seeded generator is drawn from once per generated token, chunked or not.
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    token_slot: list[int]
    segments: tuple[tuple[int, int, int], ...]
    num_decode: int
    block_tables: list[list[int]]  # per sequence, decode sequences first
    context_lens: list[int]  # per sequence: tokens of context including this step's
    prefill_query_starts: list[int]  # relative to num_decode, with the end appended
    sequences: list[Request]  # in row order
    fed: list[int]  # tokens each sequence computes this step
    completes: list[bool]  # whether each sequence samples a token this step
    sample_index: list[int]  # token index of each sampling sequence's last token, in row order
    sample_rows: list[SampleRow]  # one per sampling sequence, in row order
    # Decode steps run back to back from this plan (num_scheduler_steps; decode-only plans): each
    # next step feeds the tokens the last one sampled, one position on (:meth:`advanced`).
    steps: int = 1

    def inputs(self) -> StepInputs:
        """The forward's part of the plan."""
        return StepInputs(
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.token_slot,
            self.segments,
            self.num_decode,
            self.block_tables,
            self.context_lens,
            self.prefill_query_starts,
        )

    def advanced(self, tokens: list[int], block_size: int) -> StepPlan:
        """The next step of a decode-only window: each row feeds the token it just sampled, one
        position on, into the slot its (already grown) block table has there. A row that failed to
        sample feeds token 0 (its request fails when the window is applied; nothing reads it)."""
        pos = [p + 1 for p in self.positions]
        return replace(
            self,
            input_ids=[t if t >= 0 else 0 for t in tokens],
            positions=pos,
            slot_mapping=[t[p // block_size] * block_size + p % block_size for t, p in zip(self.block_tables, pos)],
            context_lens=[n + 1 for n in self.context_lens],
            steps=1,
        )

    def rows(self, keep: list[int]) -> StepPlan:
        """These rows of a decode-only plan, in this order (what :meth:`StepPlanner.apply` reads of
        a window's later steps: the sequences, one token fed and sampled each)."""
        return replace(
            self,
            sequences=[self.sequences[i] for i in keep],
            fed=[1] * len(keep),
            completes=[True] * len(keep),
            num_decode=len(keep),
            sample_rows=[self.sample_rows[i] for i in keep],
            steps=1,
        )

    @classmethod
    def build(
        cls, decode: list[Request], prefill: list[tuple[Request, int]], block_size: int, steps: int = 1
    ) -> StepPlan:
        """``decode`` rows feed their one new token; each ``(request, n)`` of ``prefill`` feeds
        its next ``n`` tokens; a decode-only plan may run ``steps`` of them back to back."""
        decode = sorted(decode, key=lambda r: r.lora_slot)
        prefill = sorted(prefill, key=lambda rn: rn[0].lora_slot)
        rows = [(r, 1) for r in decode] + prefill
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        token_slot: list[int] = []
        sample_index: list[int] = []
        starts = [0]
        for r, n in rows:
            seq = r.all_ids()
            new = range(r.num_computed, r.num_computed + n)
            ids.extend(seq[new.start : new.stop])
            pos.extend(new)
            slots.extend(r.block_table[p // block_size] * block_size + p % block_size for p in new)
            token_slot.extend([r.lora_slot] * n)
            if new.stop == len(seq):
                sample_index.append(len(ids) - 1)
        for _, n in prefill:
            starts.append(starts[-1] + n)
        completes = [r.num_computed + n == r.num_tokens for r, n in rows]
        return cls(
            input_ids=ids,
            positions=pos,
            slot_mapping=slots,
            token_slot=token_slot,
            segments=_segments(token_slot),
            num_decode=len(decode),
            block_tables=[list(r.block_table) for r, _ in rows],  # a snapshot for the forward thread
            context_lens=[r.num_computed + n for r, n in rows],
            prefill_query_starts=starts,
            sequences=[r for r, _ in rows],
            fed=[n for _, n in rows],
            completes=completes,
            sample_index=sample_index,
            sample_rows=[sample_row(r) for (r, _), c in zip(rows, completes) if c],
            steps=steps,
        )


def sample_row(r: Request) -> SampleRow:
    """What sampling reads of ``r``."""
    return SampleRow(r.sampling, r.generator, r.output_ids, r.prompt_ids, r.stop_ids, r.bad_words_ids, r.constraint)


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
    """Owns the step buffers and the decode graphs; runs one step at a time (one thread)."""

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
        self.buffers = StepBuffers.allocate(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            lora_h_width=lora_h_width,
            dtype=model.dtype,
            device=model.device,
        )
        model.pack_weights(ops.pack_weight, ops.linear, ops.pack_logits)  # in the layout the backend's GEMM reads
        self.ctx = ForwardContext(model, ops, pool, tables, self.buffers, block_size)
        self.graphs: DecodeGraphs | None = None
        # A window's segments and, once planned, their LoRA indices (execute_window); None outside one.
        self._lora_memo: tuple[tuple[tuple[int, int, int], ...], LoraIndices | None] | None = None
        # Structured-output masks of a step's constrained rows, filled on a thread of their own
        # while the forward runs (allocated on the first constrained step).
        self._bitmask = torch.empty(0, dtype=torch.int32)
        self._bitmask_rows, self._vocab_size = max_num_seqs, model.config.vocab_size
        self._masks: ThreadPoolExecutor | None = None
        # Under tensor parallelism: sends each step's inputs to the other ranks before this
        # rank's forward, and stops them on close (lorapage.parallel.TensorParallelGroup).
        self.send_step: Callable[[StepInputs], None] | None = None
        self.on_close: Callable[[], None] | None = None
        # Under tensor parallelism: the other ranks capture the given sizes beside this one; the
        # returned call waits until they have.
        self.send_capture: Callable[[list[int]], Callable[[], None]] | None = None

    def close(self) -> None:
        """Stop the mask thread (if a constrained step ever started it), the LoRA side thread
        (kernels/lora_side.py), and the other ranks."""
        if self._masks is not None:
            self._masks.shutdown(wait=True)
        if self.ctx.ops.lora_side is not None:
            self.ctx.ops.lora_side.close()
        if self.on_close is not None:
            self.on_close()

    def _start_masks(self, plan: StepPlan) -> Future[Tensor] | None:
        """Fill the bitmasks of the plan's constrained rows beside the forward; None if it has none."""
        constraints = [r.constraint for r in plan.sample_rows if r.constraint is not None]
        if not constraints:
            return None
        if not self._bitmask.numel():
            self._bitmask = torch.empty(self._bitmask_rows, bitmask_words(self._vocab_size), dtype=torch.int32)
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="lorapage-masks")
        assert self._masks is not None
        out = self._bitmask[: len(constraints)]

        def fill() -> Tensor:
            fill_bitmask(constraints, out)
            return out

        return self._masks.submit(fill)

    def capture_decode_graphs(self, max_num_seqs: int, capture: Capture | None = None) -> None:
        """Capture decode steps as CUDA graphs (CUDA with the Triton kernels only; ``capture``:
        see :class:`DecodeGraphs`), on every tensor-parallel rank at once."""
        sizes = batch_buckets(max_num_seqs)
        captured = self.send_capture(sizes) if self.send_capture is not None else None
        self.graphs = DecodeGraphs(self.ctx, sizes, capture)
        if captured is not None:
            captured()

    def execute(self, plan: StepPlan) -> SampleOutput:
        """Forward the plan's tokens and sample one token per sequence."""
        masks = self._start_masks(plan)
        inputs, spans, B = plan.inputs(), self._prompt_spans(plan), len(plan.block_tables)
        if self.graphs is not None and plan.num_decode == B:
            inputs = replace(inputs, graph_size=self.graphs.bucket(B) or 0)
        if self.send_step is not None:  # every logit of the step in one gather, the ranks told which
            prompt_rows = (r for _, start, n in spans for r in range(start, start + n))
            inputs = replace(inputs, logits_rows=(*prompt_rows, *plan.sample_index))
            self.send_step(inputs)
        with torch.inference_mode():
            hidden = self.forward_hidden(inputs)
            logits_of = self._logits_of(hidden, inputs.logits_rows)
            prompt_logprobs = self._prompt_logprobs(plan, spans, logits_of)
            if not plan.sample_rows:  # every sequence fed a chunk of a longer prompt
                return SampleOutput([], [], [], prompt_logprobs)
            logits = logits_of(plan.sample_index)
            out = sample(logits, plan.sample_rows, masks.result() if masks is not None else None)
            return out._replace(prompt_logprobs=prompt_logprobs) if prompt_logprobs else out

    def execute_window(self, plan: StepPlan) -> list[SampleOutput]:
        """A decode-only plan's ``plan.steps`` steps back to back, each feeding the tokens the last
        sampled: one step's sampling each. The rows' LoRA indices are planned once for all of them."""
        block_size = self.ctx.block_size
        self._lora_memo = (plan.segments, None)  # the first step plans them, the others reuse them
        try:
            outs = [self.execute(plan)]
            for _ in range(plan.steps - 1):
                plan = plan.advanced(outs[-1].tokens, block_size)
                outs.append(self.execute(plan))
        finally:
            self._lora_memo = None
        return outs

    def _logits_of(self, hidden: Tensor, rows: tuple[int, ...]) -> Callable[[list[int]], Tensor]:
        """The logits of given hidden rows: computed per call on one device; under tensor
        parallelism, rows of the step's one gathered logits (``rows``, in the order they are asked)."""
        model = self.ctx.model
        if not rows:
            # A decode step samples every row, in order: its hidden states as they are, not gathered.
            return lambda want: model.logits(hidden if want == list(range(len(hidden))) else hidden[want])
        whole = model.logits(hidden[torch.tensor(rows, device=hidden.device)])
        taken = [0]

        def take(want: list[int]) -> Tensor:
            start = taken[0]
            taken[0] += len(want)
            return whole[start : start + len(want)]

        return take

    def forward_hidden(self, inputs: StepInputs) -> Tensor:
        """The final hidden states [T, hidden] of the step's tokens, eager or replayed
        (``inputs.graph_size``): what every tensor-parallel rank runs on its shard."""
        if inputs.graph_size:
            return self._replay(inputs)
        b = self.buffers
        T, B, nd = len(inputs.input_ids), len(inputs.block_tables), inputs.num_decode
        self._write_tokens(inputs)
        width = max(len(t) for t in inputs.block_tables)
        self._write_rows(inputs, width)
        attn = AttentionMetadata(
            slot_mapping=b.slot_mapping[:T],
            num_decode=nd,
            decode_block_table=b.block_tables[:nd, :width],
            decode_context_lens=b.context_lens[:nd],
            prefill_block_table=b.block_tables[nd:B, :width],
            prefill_query_starts=inputs.prefill_query_starts,
            prefill_context_lens=inputs.context_lens[nd:],
        )
        segments = inputs.segments
        lora = self._lora(T, nd, segments) if segments else None
        with torch.inference_mode():
            return self.ctx.forward(T, attn, lora)

    def _write_tokens(self, inputs: StepInputs) -> None:
        b, T = self.buffers, len(inputs.input_ids)
        for buf, values in (
            (b.input_ids, inputs.input_ids),
            (b.positions, inputs.positions),
            (b.slot_mapping, inputs.slot_mapping),
            (b.token_slot, inputs.token_slot),
        ):
            buf[:T].copy_(torch.tensor(values, dtype=buf.dtype))

    @staticmethod
    def _prompt_spans(plan: StepPlan) -> list[tuple[int, int, int]]:
        """(row, first hidden row, rows) of each prefill row that asked for ``prompt_logprobs`` and
        whose chunk predicts prompt tokens: the chunk's hidden rows from its first position on."""
        out = []
        for i in range(plan.num_decode, len(plan.sequences)):
            req = plan.sequences[i]
            start = plan.num_decode + plan.prefill_query_starts[i - plan.num_decode]
            first = plan.positions[start]  # the chunk's first position: it predicts token first + 1
            end = min(first + plan.fed[i], req.num_prompt_tokens - 1)  # positions predicting prompt tokens
            if req.sampling.prompt_logprobs is not None and end > first:
                out.append((i, start, end - first))
        return out

    @staticmethod
    def _prompt_logprobs(
        plan: StepPlan, spans: list[tuple[int, int, int]], logits_of: Callable[[list[int]], Tensor]
    ) -> tuple[tuple[int, int, list[TokenLogprob]], ...]:
        """For each span (:meth:`_prompt_spans`): the logprobs of the prompt tokens its chunk
        predicts, from the chunk's own hidden states. Rows that did not ask cost nothing."""
        out = []
        for i, start, n in spans:
            req = plan.sequences[i]
            first = plan.positions[start]
            logits = logits_of(list(range(start, start + n)))
            top = req.sampling.prompt_logprobs
            assert top is not None
            out.append((i, first + 1, token_logprobs(logits, req.prompt_ids[first + 1 : first + n + 1], top)))
        return tuple(out)

    def _lora(self, T: int, num_decode: int, segments: tuple[tuple[int, int, int], ...]) -> LoraIndices:
        """The step's planned LoRA indices; within a window (``_lora_memo``) the first step's, as its
        rows, slots and adapters' pages stay the same to its end."""
        memo = self._lora_memo
        if memo is not None and memo[0] is segments and memo[1] is not None:
            return memo[1]
        lora = self._plan_lora(LoraIndices(self.buffers.token_slot[:T], segments), T > num_decode)
        if memo is not None and memo[0] is segments:
            self._lora_memo = (segments, lora)
        return lora

    def _plan_lora(self, lora: LoraIndices, prefill: bool) -> LoraIndices:
        """The step's LoRA indices as the backend's ops want them, planned once for every layer."""
        t = self.ctx.tables
        layout = (t.a_offset, t.a_rows, t.b_offset, t.rank, t.h_start)
        pages = self.ctx.pool.adapter_storage[0]
        return self.ctx.ops.plan_lora(lora, t.page_table, layout, pages, self.ctx.model.dtype, prefill)

    def _replay(self, inputs: StepInputs) -> Tensor:
        """A decode-only step through its captured graph: write the rows, pad, replay."""
        if self.graphs is None:
            raise ValueError(f"a step asks for the captured graph of {inputs.graph_size} rows, but none was captured")
        self._write_tokens(inputs)
        self._write_rows(inputs, self.buffers.block_tables.shape[1])  # graphs read the full width
        return self.graphs.run(len(inputs.block_tables), inputs.graph_size)

    def _write_rows(self, plan: StepInputs | StepPlan, width: int) -> None:
        """Block tables (zero-padded to ``width``) and context lengths of the plan's rows."""
        B = len(plan.block_tables)
        padded = [t + [0] * (width - len(t)) for t in plan.block_tables]
        self.buffers.block_tables[:B, :width].copy_(torch.tensor(padded, dtype=torch.int32))
        self.buffers.context_lens[:B].copy_(torch.tensor(plan.context_lens, dtype=torch.int32))

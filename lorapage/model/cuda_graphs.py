"""CUDA-graph capture and replay of decode steps.

One graph per batch-size bucket (largest first, one shared memory pool), captured over the
runner's static buffers. A replay serves any mix of adapters: everything that says which adapter
a row uses (``token_slot``, the slot -> pages table, ranks, scales, offsets) is a tensor the graph
reads, written between replays, never reallocated. So the number of graphs is the number of
buckets, whatever the number of adapters or ranks, and loading or evicting adapters never
invalidates a graph. Only decode-only steps replay; steps with prefill tokens run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lorapage.kernels import LoraIndices
from lorapage.model.llama import AttentionMetadata

if TYPE_CHECKING:
    from lorapage.model.runner import ModelRunner


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (vLLM's spacing), largest first."""
    sizes = {b for b in (1, 2, 4) if b <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return sorted(sizes, reverse=True)


# A capture turns a step (a function returning its output tensor) into (replay, output): calling
# replay reruns the step on whatever the static buffers hold now, leaving its result in output.
Capture = Callable[[Callable[[], Tensor]], tuple[Callable[[], None], Tensor]]


def cuda_graph_capture() -> Capture:
    """Captures as CUDA graphs sharing one memory pool (capture the largest bucket first)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(step: Callable[[], Tensor]) -> tuple[Callable[[], None], Tensor]:
        step()  # warm-up: compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()
        return graph.replay, out

    return capture


class DecodeGraphs:
    """Captured decode steps, keyed by bucket size; ``run`` pads a batch to its bucket and replays.

    ``capture`` defaults to CUDA graphs. Tests on a machine without CUDA pass one that reruns the
    step on replay, so the padding, bucket choice and buffer writes around a replay are checked
    there too (``tests/test_kernels_graph_safety.py``).
    """

    def __init__(self, runner: ModelRunner, max_num_seqs: int, capture: Capture | None = None) -> None:
        self.runner = runner
        self.graphs: dict[int, tuple[Callable[[], None], Tensor]] = {}
        capture = capture or cuda_graph_capture()
        for size in batch_buckets(max_num_seqs):
            self._pad(0, size)
            self.graphs[size] = capture(lambda size=size: decode_forward(self.runner, size))
        if runner.pool.storage.is_cuda:
            torch.cuda.synchronize()

    def bucket(self, batch: int) -> int | None:
        fits = [b for b in self.graphs if b >= batch]
        return min(fits) if fits else None

    def run(self, batch: int) -> Tensor:
        """Replay for the first ``batch`` rows already written into the runner's buffers."""
        size = self.bucket(batch)
        self._pad(batch, size)
        replay, hidden = self.graphs[size]
        replay()
        return hidden[:batch]

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) become harmless: token 0 at position 0, no adapter, writing their K/V
        into the dummy page 0 and attending over it alone."""
        r = self.runner
        for buf in (r.input_ids, r.positions, r.slot_mapping, r.token_slot, r.block_tables):
            buf[start:end].zero_()
        r.context_lens[start:end].fill_(1)


def decode_forward(runner: ModelRunner, size: int) -> Tensor:
    """The decode step a graph captures: the first ``size`` rows of the runner's static buffers
    through the model. Everything it reads is a view of a buffer allocated once or a constant of
    ``size``; ``tests/test_kernels_graph_safety.py`` checks that its kernel launches do not change
    with the adapters, slots, pages or positions written into those buffers."""
    r = runner
    attn = AttentionMetadata(
        slot_mapping=r.slot_mapping[:size],
        num_decode=size,
        decode_block_table=r.block_tables[:size],
        decode_context_lens=r.context_lens[:size],
        prefill_block_table=r.block_tables[:0],
        prefill_query_starts=[0],
        prefill_context_lens=[],
    )
    # The segments are a placeholder: BGMV reads token_slot on the device, so the LoRA kernels
    # are always in the graph and rows with slot 0 skip them.
    lora = LoraIndices(r.token_slot[:size], ((0, size, 0),))
    with torch.inference_mode():
        return r.model.forward(
            r.input_ids[:size],
            r.positions[:size],
            attn,
            r.pool.storage,
            r.block_size,
            r.ops,
            r.tables,
            lora,
            r.lora_h,
        )

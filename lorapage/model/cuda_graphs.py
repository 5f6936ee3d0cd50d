"""CUDA-graph capture and replay of decode steps.

One graph per batch-size bucket (largest first, one shared memory pool), captured over the
runner's static buffers. A replay serves any mix of adapters: everything that says which adapter
a row uses (``token_slot``, the slot -> pages table, ranks, scales, offsets) is a tensor the graph
reads, written between replays, never reallocated. So the number of graphs is the number of
buckets, whatever the number of adapters or ranks, and loading or evicting adapters never
invalidates a graph. Only decode-only steps replay; steps with prefill tokens run eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from lorapage.model.forward import ForwardContext, decode_forward


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
    there too (``tests/kernels/test_kernels_graph_safety.py``).
    """

    def __init__(self, ctx: ForwardContext, max_num_seqs: int, capture: Capture | None = None) -> None:
        self.buffers = ctx.buffers
        self.graphs: dict[int, tuple[Callable[[], None], Tensor]] = {}
        capture = capture or cuda_graph_capture()
        for size in batch_buckets(max_num_seqs):
            self.buffers.pad_rows(0, size)
            self.graphs[size] = capture(functools.partial(decode_forward, ctx, size))
        if ctx.pool.storage.is_cuda:
            torch.cuda.synchronize()

    def bucket(self, batch: int) -> int | None:
        fits = [b for b in self.graphs if b >= batch]
        return min(fits) if fits else None

    def run(self, batch: int) -> Tensor:
        """Replay for the first ``batch`` rows already written into the step buffers (a batch
        that fits a bucket: check with :meth:`bucket` first)."""
        size = self.bucket(batch)
        if size is None:
            raise ValueError(f"no captured graph holds {batch} rows")
        self.buffers.pad_rows(batch, size)
        replay, hidden = self.graphs[size]
        replay()
        return hidden[:batch]

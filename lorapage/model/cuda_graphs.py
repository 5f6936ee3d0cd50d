"""CUDA-graph capture and replay of decode steps.

One graph per batch-size bucket (largest first, one shared memory pool), captured over the
runner's static buffers. A replay serves any mix of adapters: everything that says which adapter
a row uses (``token_slot``, the slot -> pages table, ranks, scales, offsets) is a tensor the graph
reads, written between replays, never reallocated. So the number of graphs is the number of
buckets, whatever the number of adapters or ranks, and loading or evicting adapters never
invalidates a graph. Only decode-only steps replay; steps with prefill tokens run eagerly.

Under tensor parallelism every rank captures the same sizes in the same order at the same time
(rank 0 sends them, :class:`lorapage.parallel.wire.CaptureMessage`), so each warm-up's collectives
meet their peers' and each graph holds the same collectives as its peers' graph of that size; a
replay's size is rank 0's choice, sent in the step's inputs (``StepInputs.graph_size``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

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


def rerun_capture(step: Callable[[], Tensor]) -> tuple[Callable[[], None], Tensor]:
    """The stand-in where there are no CUDA graphs (a CPU): nothing is recorded; a replay reruns
    the step eagerly on whatever the static buffers hold, into the output of its first run. Its
    collectives run as a graph's would: one eager run per size at capture, one per replay."""
    out = step()

    def replay() -> None:
        with torch.inference_mode():  # out was made under it, as a graph's output is
            out.copy_(step())

    return replay, out


class DecodeGraphs:
    """Captured decode steps, keyed by bucket size; ``run`` pads a batch to its bucket and replays.

    ``capture`` defaults to CUDA graphs. Tests on a machine without CUDA pass one that reruns the
    step on replay, so the padding, bucket choice and buffer writes around a replay are checked
    there too (``tests/kernels/test_kernels_graph_safety.py``).
    """

    def __init__(self, ctx: ForwardContext, sizes: Sequence[int], capture: Capture | None = None) -> None:
        """Capture a decode step of each of ``sizes`` rows, in that order (largest first)."""
        self.buffers = ctx.buffers
        self.graphs: dict[int, tuple[Callable[[], None], Tensor]] = {}
        capture = capture or cuda_graph_capture()
        for size in sizes:
            self.buffers.pad_rows(0, size)
            self.graphs[size] = capture(functools.partial(decode_forward, ctx, size))
        if ctx.pool.storage.is_cuda:
            torch.cuda.synchronize()

    def bucket(self, batch: int) -> int | None:
        fits = [b for b in self.graphs if b >= batch]
        return min(fits) if fits else None

    def run(self, batch: int, size: int) -> Tensor:
        """Replay the graph of ``size`` rows (the step's bucket, :meth:`bucket`, chosen by rank 0
        under tensor parallelism) for the first ``batch`` rows already written into the step
        buffers, the rest padded."""
        if size not in self.graphs or batch > size:
            raise ValueError(f"no captured graph of {size} rows holds {batch} rows (captured: {sorted(self.graphs)})")
        self.buffers.pad_rows(batch, size)
        replay, hidden = self.graphs[size]
        replay()
        return hidden[:batch]

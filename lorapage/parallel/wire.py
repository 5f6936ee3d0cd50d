"""What crosses from rank 0 to the worker ranks, and the collective the ranks share.

Control goes over one pipe per worker, in order: a worker's messages are applied exactly in the
order rank 0 sent them, so an adapter's pages are written on every rank before any step that
reads its slot (rank 0 marks the adapter resident only after sending them). Data (the partial
sums of the row-parallel projections, the vocabulary-parallel embedding and logits, the sharded
LoRA's shrinks) goes over a ``torch.distributed`` process group made
directly on a file store in a private temporary directory: no port to choose, no default group,
so several engines (and their ranks) share a host and a process without colliding.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lorapage.adapters.layout import AdapterLayout
from lorapage.model.rank_comm import RankComm
from lorapage.model.runner import StepInputs


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker rank needs to build its shard: the same numbers rank 0 built its own from."""

    model_dir: str
    world_size: int
    timeout_s: float  # a collective waiting longer than this fails (a rank died mid-step)
    device: str
    dtype: torch.dtype
    lora_dtype: torch.dtype
    kernel_backend: str
    threads: int  # intra-op threads of the worker's forward
    max_model_len: int
    block_size: int
    page_size: int  # the shard's: elements of one page in one layer
    num_pages: int
    lora_slots: int
    page_list_width: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_blocks: int
    lora_h_width: int
    quantization: str | None = None  # --quantization: each rank quantizes its own shard
    quantize_lm_head: bool = False
    rank: int = 0
    store_path: str = ""  # the process group's rendezvous file (set by TensorParallelGroup)


@dataclass(frozen=True)
class StepMessage:
    """One step: the plan's token rows (every rank runs the same forward on its shard)."""

    inputs: StepInputs


@dataclass(frozen=True)
class CaptureMessage:
    """Capture the decode step's graphs of these sizes, in this order, now: rank 0 captures the
    same ones at the same time, so every warm-up's collectives meet their peers' and the graphs
    of one size hold the same collectives on every rank. The worker answers ``CAPTURED`` (or its
    error, and exits)."""

    sizes: tuple[int, ...]


@dataclass(frozen=True)
class PagesMessage:
    """An adapter load: this rank's shard of the packed adapter, the slot and the pages (the same
    page ids on every rank: rank 0's pool plan is every rank's)."""

    layout: AdapterLayout
    packed: Tensor  # [num_layers, num_pages * adapter_page_size], this rank's shard
    slot: int
    pages: list[int]


STOP = "stop"
CAPTURED = "captured"


class Group(Protocol):
    """A c10d backend's collective this code uses (its stubs do not declare it)."""

    def allreduce(self, tensors: list[Tensor]) -> dist.Work: ...

    def allgather(self, output: list[list[Tensor]], tensors: list[Tensor]) -> dist.Work: ...

    def gather(self, output: list[list[Tensor]], tensors: list[Tensor], opts: dist.GatherOptions) -> dist.Work: ...


def process_group(spec: WorkerSpec) -> Group:
    """The ranks' group (blocks until every rank joined): NCCL on CUDA, gloo over loopback elsewhere."""
    store = dist.FileStore(spec.store_path, spec.world_size)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return cast(Group, dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, options))
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # its options, only private
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    return cast(Group, dist.ProcessGroupGloo(store, spec.rank, spec.world_size, options))


def rank_comm(group: Group, rank: int, world: int, guard: Callable[[Callable[[], object]], None]) -> RankComm:
    """The collectives a rank's forward calls over ``group``, each run through ``guard`` (rank 0's
    turns a failed collective into the group's failure)."""

    def all_reduce(t: Tensor) -> None:
        guard(lambda: group.allreduce([t]).wait())

    def all_gather(t: Tensor) -> Tensor:
        out = t.new_empty(world, *t.shape)
        guard(lambda: group.allgather([list(out.unbind(0))], [t]).wait())
        return out

    def gather(t: Tensor) -> Tensor:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if rank:
            guard(lambda: group.gather([], [t], opts).wait())
            return t
        out = t.new_empty(world, *t.shape)
        guard(lambda: group.gather([list(out.unbind(0))], [t], opts).wait())
        return out

    return RankComm(rank, world, all_reduce, all_gather, gather)


def unguarded(run: Callable[[], object]) -> None:
    """A worker's guard: a failed collective raises (and ends the worker)."""
    run()

"""Rank 0's side of tensor parallelism: starts the worker ranks with the engine, sends them each
step's inputs and each adapter's shards, and stops them on close.

Rank 0 is the engine's own process: its forward thread runs rank 0's shard after sending the step
to the workers, then samples alone from the logits gathered to it (the vocabulary-parallel
lm_head); nothing comes back over the pipes. A worker that dies is seen before the next step (its process is gone) or
by the collective it leaves waiting (gloo's closed connection, else the group's timeout); from
then on every step fails at once with :class:`TensorParallelError`, so requests fail and none hangs.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from torch import Tensor

from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.loader import AdapterTensors
from lorapage.errors import EngineStepError
from lorapage.model.config import ModelConfig
from lorapage.model.rank_comm import RankComm
from lorapage.model.runner import StepInputs
from lorapage.parallel.shards import checkpoint_weight, shard_lora, shard_section
from lorapage.parallel.wire import (
    CAPTURED,
    STOP,
    CaptureMessage,
    PagesMessage,
    StepMessage,
    WorkerSpec,
    process_group,
    rank_comm,
)
from lorapage.parallel.worker import run_worker

START_TIMEOUT_S = 300.0  # a worker loading its shard of a large base
STOP_TIMEOUT_S = 10.0


class TensorParallelError(EngineStepError):
    """A tensor-parallel rank died or failed: the engine cannot step any more (a supervisor
    restarts it). 503: the service, not the request."""

    status = 503
    code = "unavailable"


class TensorParallelGroup:
    """The worker ranks 1..world_size-1 of one engine, and rank 0's end of the process group."""

    def __init__(self, spec: WorkerSpec) -> None:
        """Start the workers from ``spec`` (rank 0's; each worker's differs in its rank) and join the
        group; returns once every worker has built its shard. ``spec.store_path`` is ignored: a
        private temporary directory holds the rendezvous file."""
        self.world_size = spec.world_size
        self._dir = Path(tempfile.mkdtemp(prefix="lorapage-tp-"))
        spec = replace(spec, store_path=str(self._dir / "store"))
        self.spec = spec  # rank 0's: what each worker built its shard from (with its rank)
        ctx = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self.processes: list[BaseProcess] = []
        self._send_lock = threading.Lock()  # the forward thread (steps) and the copy thread (pages)
        self._failure: str | None = None
        for rank in range(1, spec.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker,
                args=(replace(spec, rank=rank, device=rank_device(spec.device, rank)), theirs),
                name=f"lorapage-tp-{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self.processes.append(proc)
        try:
            self._expect("joining")  # a worker that fails to start (an import, a device) is seen at once
            try:
                self.group = process_group(spec)
            except Exception:
                self._raise_reason()  # a worker that failed after joining says why: that, not gloo's words
                raise
            self._expect("ready")
            self.model = ModelConfig.from_dir(spec.model_dir)  # the whole base's: an adapter's section is planned on it
            self.base_weight = checkpoint_weight(spec.model_dir, self.model)  # DoRA's norms, over whole weights
        except BaseException:
            self.close()
            raise
        self.comm: RankComm = rank_comm(self.group, 0, self.world_size, self._guard)

    def _expect(self, word: str) -> None:
        """Wait for every worker to say ``word``: TensorParallelError with what it said instead, or
        when it exits or takes longer than START_TIMEOUT_S."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (conn, proc) in enumerate(zip(self._conns, self.processes, strict=True), 1):
            while not conn.poll(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    state = f"exited (code {proc.exitcode})" if not proc.is_alive() else "did not answer"
                    raise TensorParallelError(f"tensor-parallel rank {rank} {state} while starting")
            if (said := conn.recv()) != word:
                raise TensorParallelError(str(said))

    def _raise_reason(self) -> None:
        """TensorParallelError with the first reason a worker has sent, if one has (no waiting)."""
        for conn in self._conns:
            if conn.poll(0):
                said = conn.recv()
                if isinstance(said, str) and said not in ("joining", "ready"):
                    raise TensorParallelError(said)

    def _check(self) -> None:
        """TensorParallelError if a rank has died or failed before."""
        if self._failure is None:
            for rank, proc in enumerate(self.processes, 1):
                if not proc.is_alive():
                    self._failure = f"tensor-parallel rank {rank} died (exit code {proc.exitcode})"
                    break
        if self._failure is not None:
            raise TensorParallelError(f"{self._failure}; the engine cannot step any more: restart it")

    def _send(self, msg: object, per_rank: list[object] | None = None) -> None:
        with self._send_lock:
            self._check()
            try:
                for i, conn in enumerate(self._conns):
                    conn.send(msg if per_rank is None else per_rank[i])
            except OSError as exc:  # a closed pipe: the worker is gone
                self._failure = f"tensor-parallel rank {i + 1} is unreachable ({exc})"
                self._check()

    def send_step(self, inputs: StepInputs) -> None:
        """Every worker runs this step's forward beside rank 0's."""
        self._send(StepMessage(inputs))

    def send_capture(self, sizes: list[int]) -> Callable[[], None]:
        """Every worker captures the decode graphs of ``sizes`` (in order) while rank 0 captures its
        own; call the result after rank 0's capture to wait for theirs (TensorParallelError with a
        worker's reason when one failed)."""
        self._send(CaptureMessage(tuple(sizes)))
        return lambda: self._expect(CAPTURED)

    def split(self, tensors: AdapterTensors) -> list[AdapterTensors]:
        """Each rank's shard of an adapter's (A, B) matrices, rank 0 first."""
        return [shard_lora(tensors, rank, self.world_size) for rank in range(self.world_size)]

    def split_section(self, section: Tensor, vectors: bool) -> list[Tensor]:
        """Each rank's variant data of an adapter's whole (DoRA / lora_bias rows when ``vectors``,
        then any embedding LoRA's), rank 0 first."""
        w = self.world_size
        return [shard_section(section, rank, w, self.model, vectors) for rank in range(w)]

    def send_pages(self, layout: AdapterLayout, packed: Tensor, slot: int, pages: list[int]) -> None:
        """Worker ``r`` writes ``packed[r - 1]`` (its shard) into ``pages`` and points ``slot`` at them."""
        self._send(None, [PagesMessage(layout, packed[i], slot, pages) for i in range(len(self._conns))])

    def _guard(self, collective: Callable[[], object]) -> None:
        """Run a collective, failing the group (not only the step) when a rank is gone mid-step."""
        try:
            collective()
        except RuntimeError as exc:
            self._failure = f"a tensor-parallel collective failed ({exc})"
            self._check()

    def close(self) -> None:
        """Stop the workers (kill any that do not stop in time) and remove the rendezvous directory."""
        for conn in self._conns:
            try:
                conn.send(STOP)
            except OSError:
                pass
        for proc in self.processes:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._failure = self._failure or "the tensor-parallel group was closed"
        shutil.rmtree(self._dir, ignore_errors=True)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device when rank 0 runs on ``device``: the next GPUs after rank 0's (``cuda:2``
    with 2 ranks: ``cuda:2``, ``cuda:3``); a CPU for every rank on a CPU."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


__all__ = ["TensorParallelGroup", "TensorParallelError", "rank_device"]
